"""What the Conductor's admission did over a simulated run, for the report (``RunResult.extra``).

Counters the live gateway shows in ``/admin/state`` and its metrics; here read once, at the end.
"""

from __future__ import annotations

from routing.conductor import Conductor


def admission_counters(conductor: Conductor) -> dict[str, object]:
    admission, stats, queue = conductor.admission, conductor.stats, conductor.decode_queue
    control, margin = admission.headroom_for(None), admission.wait_margin_for(None)
    credit = admission.stall_credit_for(None)
    return {
        # Rejections the decode reservation made that the plain TBT check would have admitted.
        "reserve_turned_away": admission.turned_away_by_reserve,
        "decode_rebinds": stats.rebinds,
        "decode_tbt_moves": stats.tbt_moves,
        # Requests that waited for decode room (routing/decode_queue.py).
        "decode_queue": {
            "parked": queue.parked,
            "admitted": queue.admitted,
            "expired": queue.expired,
        },
        "doomed_warmups": stats.warmups,
        # The share of the TBT headroom in force at the end, and how often it moved.
        "tbt_headroom_share": round(control.share, 3),
        "tbt_headroom_moves": control.raised + control.lowered,
        # The factor on predicted waits at the end (routing/wait_margin.py), and its moves.
        "wait_margin": round(margin.factor, 3),
        "wait_margin_moves": margin.raised + margin.lowered,
        # The colocated prefill-stall check's slack credit at the end (routing/stall_credit.py).
        "stall_credit": round(credit.credit, 3),
        "stall_credit_moves": credit.raised + credit.lowered,
    }
