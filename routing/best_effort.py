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
so in ``x-kvgate-admission: best-effort``) when three things hold:

- it would start at once: the chosen instance has no prefill booked, so nobody already
  placed there waits for it;
- the fleet has spare prefill capacity: at least ``idle_share`` of the pool is idle too, so
  requests arriving during its long prefill have somewhere else to go;
- it pays: at least ``min_reuse`` of the doomed prompts seen lately were extended by a later
  request within ``reuse_horizon_s`` (routing/prefix_reuse.py; 46-63 % on the synthetic trace,
  26-35 % on the conversation trace, where serving them late cost up to 2 % of goodput).

The last two are waived when the whole prefill pool is idle: then nothing else could use the
fleet, and rejecting would be for nobody's benefit. That bounds starvation: a prompt too long
for the SLO is turned away only while some prefill instance of its pool has work booked (or
its decode instance would break the TBT SLO).

The decode-side TBT check still applies in full; only the TTFT promise is waived, and only
the configured one: a request that sets its own TTFT SLO (``x-slo-ttft-ms``) asked for a
deadline, and is rejected as before. Pure: the caller passes ``now``.
"""

from __future__ import annotations

from collections.abc import Sequence

from config.settings import AdmissionMode, AdmissionSettings, BestEffortSettings
from routing.admission import EffectiveSLO
from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.prefix_reuse import PrefixReuse
from routing.types import RequestInfo

_SLO_MODES = (AdmissionMode.EARLY, AdmissionMode.PREDICTIVE)


class BestEffort:
    __slots__ = ("reuse", "settings")

    def __init__(self, settings: BestEffortSettings) -> None:
        self.settings = settings
        self.reuse = PrefixReuse(settings.reuse_horizon_s)

    def reconfigure(self, settings: BestEffortSettings) -> None:
        """New settings live; the measured reuse survives unless its horizon changed."""
        if settings.reuse_horizon_s != self.settings.reuse_horizon_s:
            self.reuse = PrefixReuse(settings.reuse_horizon_s)
        self.settings = settings

    def review(
        self,
        req: RequestInfo,
        option: PrefillOption,
        slo: EffectiveSLO,
        admission: AdmissionSettings,
        pool: Sequence[InstanceState],
        now: float,
    ) -> bool:
        """Whether ``req``, placed on ``option``, is served best effort: True only when the
        TTFT check would reject it and every condition above holds. Also feeds the reuse
        measurement (every reviewed request may extend a watched prompt)."""
        s = self.settings
        if not s.enabled or admission.mode not in _SLO_MODES:
            return False
        reuse = self.reuse
        reuse.observe(req.block_hashes, now)
        if req.slo_ttft_s is not None:  # a client's own deadline stays a hard one
            return False
        limit = slo.ttft_limit_s
        margin = admission.ttft_margin
        if (option.ttft_s - option.queue_s) * margin <= limit:
            return False  # it could meet the SLO on an idle instance: not doomed
        reuse.watch(req.block_hashes, now)
        if not _idle(option.instance, now):
            return False
        idle = sum(1 for inst in pool if _idle(inst, now))
        if idle == len(pool):  # nothing else could use the fleet now: never starve it here
            return True
        return idle >= s.idle_share * len(pool) and reuse.rate >= s.min_reuse


def _idle(inst: InstanceState, now: float) -> bool:
    """No prefill booked, not even one whose predicted end has passed or that waits for its
    prefix pull to land: a request already placed here must never wait behind a long prefill
    that was admitted because the books thought the instance free (a late pull did, in the
    simulator, until this counted them)."""
    return not inst.prefill_queue and inst.queue_time(now) <= 0.0
