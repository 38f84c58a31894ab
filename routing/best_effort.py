"""Best-effort admission: serve late what no instance could serve in time, when it is free to.

The SLO admission modes reject a request whose predicted TTFT misses the SLO. For most such
requests that is right: they wait behind a queue, and serving them late would delay others.
Some miss it even on an idle instance: a prompt whose prefill alone takes longer than the SLO
("doomed"). Rejecting those is final (a retry is just as doomed), and it also costs the
session's later turns: each one extends the rejected prompt, finds nothing cached, and is
doomed in turn. On the Mooncake synthetic trace, with a 5 s TTFT SLO at 1× load, early
admission rejected 593 requests (median 41.6k prompt tokens); a peer that admits everything
served 426 of them within the SLO, 99 % of their prompt cached by the earlier turns.

So a doomed request is admitted as *best effort* (``Decision.best_effort``; the gateway says
so in ``x-kvgate-admission: best-effort``) when it only takes capacity nobody else is using:

- its prefill instance has nothing booked, not even a prefill whose predicted end has passed
  or that waits for its prefix pull to land (a request already placed there must never wait
  behind it);
- at least ``idle_share`` of the prefill pool is idle too, so requests arriving during its
  long prefill have somewhere else to go;
- the TBT its decode instance is checked at (today's, or the forecast under ``predictive``)
  is at most ``max_decode_load`` of the TBT limit: its long context then takes decode room
  that is spare, not the room of the requests that come after it.

That bounds starvation: a prompt too long for the SLO is rejected only while the fleet is busy
(its instance has work booked, half the pool is busy, or decode is above that load); before,
it was rejected always. The TBT check itself still applies; only the TTFT promise is waived,
and only the configured one: a request that sets its own TTFT SLO (``x-slo-ttft-ms``) asked
for a deadline and is rejected as before. docs/experiments.md §2.3 measures each condition.
Pure: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence

from config.settings import AdmissionSettings
from routing.admission import SLO_MODES, EffectiveSLO
from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.types import RequestInfo


def serve_best_effort(
    req: RequestInfo,
    option: PrefillOption,
    tbt_s: float,
    slo: EffectiveSLO,
    admission: AdmissionSettings,
    pool: Sequence[InstanceState],
    now: float,
) -> bool:
    """Whether ``req``, placed on ``option`` with its decode checked at ``tbt_s``, is served
    best effort: True only when the TTFT check would reject it even on an idle instance and
    every condition above holds."""
    s = admission.best_effort
    if not s.enabled or not doomed(req, option, slo, admission):
        return False
    if tbt_s * admission.tbt_margin > s.max_decode_load * slo.tbt_limit_s:
        return False
    if not nothing_booked(option.instance, now):
        return False
    idle = sum(1 for inst in pool if nothing_booked(inst, now))
    return idle >= s.idle_share * len(pool)


def doomed(
    req: RequestInfo, option: PrefillOption, slo: EffectiveSLO, admission: AdmissionSettings
) -> bool:
    """Whether the TTFT check would reject ``req`` on ``option`` even with no queue there, under
    an SLO admission mode and the configured TTFT SLO (a client's own deadline is its own)."""
    if admission.mode not in SLO_MODES or req.slo_ttft_s is not None:
        return False
    return (option.ttft_s - option.queue_s) * admission.ttft_margin > slo.ttft_limit_s


def nothing_booked(inst: InstanceState, now: float) -> bool:
    """No prefill booked, not even one the books think done (a late pull keeps it waiting)."""
    return not inst.prefill_queue and inst.queue_time(now) <= 0.0
