"""Baselines: random, round robin, least load, longest prefix."""

from __future__ import annotations

from typing import ClassVar

from routing.estimates import PrefillOption
from routing.policies.base import PlacementContext, PolicyBase, min_queue


class RandomPolicy(PolicyBase):
    """Uniformly random prefill instance (FAST'25 Figure 5's "random")."""

    name: ClassVar[str] = "random"

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        return ctx.estimator.local(ctx.rng.choice(ctx.prefill_candidates))


class RoundRobinPolicy(PolicyBase):
    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        inst = cands[self._next % len(cands)]
        self._next += 1
        return ctx.estimator.local(inst)


class LeastLoadPolicy(PolicyBase):
    """Shortest predicted prefill queue (FAST'25 Figure 5's "load-balancing")."""

    name: ClassVar[str] = "least_load"

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        return ctx.estimator.local(min_queue(ctx.prefill_candidates, ctx.now))


class LongestPrefixPolicy(PolicyBase):
    """Most locally cached blocks; ties broken by the shorter queue."""

    name: ClassVar[str] = "longest_prefix"

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        local = ctx.match.local_blocks
        best = None
        best_key = (0, 0.0)
        for inst in ctx.prefill_candidates:
            key = (local.get(inst.id, 0), -inst.queue_time(ctx.now))
            if best is None or key > best_key:
                best, best_key = inst, key
        assert best is not None
        return ctx.estimator.local(best)
