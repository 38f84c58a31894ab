"""Mooncake's Conductor placement (FAST'25 Algorithm 1), local-only and global variants."""

from __future__ import annotations

from typing import ClassVar

from config.settings import AdmissionMode
from routing.estimates import PrefillOption
from routing.policies.base import PlacementContext, PolicyBase


class CacheAwarePolicy(PolicyBase):
    """Algorithm 1 with each instance's own prefix only: min over T_queue + T_prefill(n, local).

    FAST'25 Figure 5's "local cache-aware"; no transfers between instances.
    """

    name: ClassVar[str] = "cache_aware"
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.EARLY

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        est = ctx.estimator
        best = None
        for inst in ctx.prefill_candidates:
            opt = est.local(inst)
            if best is None or opt.ttft_s < best.ttft_s:
                best = opt
        assert best is not None
        return best


class KVCacheCentricPolicy(PolicyBase):
    """The full Conductor: local, pulled (from the best holder) or store-loaded prefixes.

    FAST'25 Figure 5's "global cache-aware"; Mooncake ships it with prediction-based early
    rejection. The pulls it chooses are issued as reactive replication commands.
    """

    name: ClassVar[str] = "kvcache_centric"
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.PREDICTIVE
    uses_transfers: ClassVar[bool] = True

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        est = ctx.estimator
        best = None
        for inst in ctx.prefill_candidates:
            opt = est.best(inst)
            if best is None or opt.ttft_s < best.ttft_s:
                best = opt
        assert best is not None
        return best
