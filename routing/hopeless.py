"""The hopeless check: a TTFT rejection decided before the prompt is tokenized.

Under overload most of a rejected request's cost is not the decision but reading, tokenizing
and hashing its prompt (docs/reliability.md, "Overload and soak"). Some requests need none of
that to be judged: when even the best case misses the TTFT SLO, the full decision cannot
admit them. The best case here is the shortest queue wait among the instances that could run
the prefill, as if the whole prompt were cached and took no time to prefill, load or pull.

Soundness (tests/routing/test_hopeless.py checks it against the full ``schedule``): every
prefill option the Conductor can admit has a predicted TTFT of at least its instance's queue
wait (local, pull and store options add non-negative load, transfer and prefill times; a
policy may only add to them; a conditional-disaggregation prefill on a decode instance waits
for that instance's queue, so those instances are candidates too when it is on), and the
admission check is ``ttft * ttft_margin > ttft_limit``, monotone in the TTFT. So if the
shortest wait already fails that check, so does the option the full path would choose, at the
same ``now``. The full path may still reject for another reason first (``kv_capacity``, when
no decode instance has room): the request is rejected either way.

Only the SLO admission modes (``early``, ``predictive``) are judged; ``none`` and ``peer`` never
reject on TTFT. Pure: the caller passes ``now`` and the candidates; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from config.settings import AdmissionSettings
from routing.admission import SLO_MODES, EffectiveSLO
from routing.instance_books import InstanceState
from routing.types import Rejection, RejectReason


def best_case_ttft(candidates: Sequence[InstanceState], now: float) -> float:
    """A lower bound on any candidate's predicted TTFT: the shortest queue wait."""
    return min(inst.queue_time(now) for inst in candidates)


def hopeless_rejection(
    request_id: str,
    candidates: Sequence[InstanceState],
    slo: EffectiveSLO,
    admission: AdmissionSettings,
    now: float,
) -> Rejection | None:
    """The ``ttft_slo`` rejection the full decision would also reach, or None (then decide
    normally). No candidates: None, the full path answers ``no_healthy_*``."""
    if admission.mode not in SLO_MODES or not candidates:
        return None
    floor = best_case_ttft(candidates, now)
    predicted = floor * admission.ttft_margin
    limit = slo.ttft_limit_s
    if not predicted > limit:
        return None
    retry = min(max(predicted - limit, admission.retry_after_min_s), admission.retry_after_max_s)
    return Rejection(
        request_id,
        RejectReason.TTFT_SLO,
        f"predicted TTFT at least {predicted * 1000:.0f} ms (the shortest queue wait) exceeds"
        f" the TTFT SLO limit {limit * 1000:.0f} ms",
        retry,
        predicted_ttft_s=floor,
        limit_s=limit,
        priority=slo.priority.name,
    )
