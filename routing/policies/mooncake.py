"""Mooncake's Conductor placement (FAST'25 Algorithm 1), local-only and global variants."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from config.settings import AdmissionMode
from routing.estimates import PrefillOption
from routing.fleet_pools import rotated
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, PolicyBase


def _by_queue(candidates: list[InstanceState], now: float, rotation: int) -> list[InstanceState]:
    """Shortest queue first, so that a good option is found early and most others are pruned.
    Idle instances come first, the one idle longest first: an exact tie (a cold prompt, an
    idle fleet) then goes to the instance used least recently, which spreads cold work and its
    prefixes over every instance's cache instead of piling it on the pools' first instance
    (whose cache then churns while others stay empty). A replica starts ``rotation`` places
    into that order, so that replicas deciding together still pick different instances."""
    idle = sorted(
        (i for i in candidates if i.busy_until_s <= now),
        key=lambda i: (i.busy_until_s, i.bit_order),
    )
    busy = sorted((i for i in candidates if i.busy_until_s > now), key=lambda i: i.busy_until_s)
    return rotated(idle, rotation) + busy


def _argmin_ttft(
    ctx: PlacementContext, option: Callable[[InstanceState], PrefillOption]
) -> PrefillOption:
    """The option with the least predicted TTFT over the prefill candidates (plus, on a
    llama.cpp slot, the recompute of the shared prefix it would overwrite: ``rank_s``).

    Queue + the cheapest prefill any option could have bounds an instance's TTFT from below,
    so instances that cannot beat the best so far are skipped: same result, fewer estimates.
    """
    est = ctx.estimator
    now = ctx.now
    bounds: dict[int, float] = {}
    best: PrefillOption | None = None
    best_ttft = float("inf")
    for inst in _by_queue(ctx.prefill_candidates, now, ctx.tie_rotation):
        # A learned queue scale below 1 shortens the wait: the bound must shrink with it.
        queue = (inst.busy_until_s - now) * min(inst.queue_scale, 1.0)
        if best is not None:
            key = id(inst.predictors)
            floor = bounds.get(key)
            if floor is None:
                floor = bounds[key] = est.min_prefill(inst)
            if queue + floor >= best_ttft:
                continue
        opt = option(inst)
        if opt.rank_s < best_ttft:
            best, best_ttft = opt, opt.rank_s
    assert best is not None
    return best


class CacheAwarePolicy(PolicyBase):
    """Algorithm 1 with each instance's own prefix only: min over T_queue + T_prefill(n, local).

    FAST'25 Figure 5's "local cache-aware"; no transfers between instances.
    """

    name: ClassVar[str] = "cache_aware"
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.EARLY

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        return _argmin_ttft(ctx, ctx.estimator.local)


class KVCacheCentricPolicy(PolicyBase):
    """The full Conductor: local, pulled (from the best holder) or store-loaded prefixes.

    FAST'25 Figure 5's "global cache-aware"; Mooncake ships it with prediction-based early
    rejection. The pulls it chooses are issued as reactive replication commands.
    """

    name: ClassVar[str] = "kvcache_centric"
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.PREDICTIVE

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        return _argmin_ttft(ctx, ctx.estimator.best)
