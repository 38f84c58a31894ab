"""NVIDIA Dynamo KV router: the default ("linear") worker cost, prefill and decode routers.

Source: ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector.rs`` (``worker_logit``,
``softmax_sample``) and ``selector/default.rs`` (commit ``07a6c9ce``, 2026), defaults in
``lib/kv-router/src/scheduling/config.rs``; disaggregated behaviour from
``docs/components/router/router-concepts.md``. Audit notes: docs/peer-fidelity.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar

from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, PolicyBase


def blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def softmax_pick(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Dynamo's ``softmax_sample``: costs normalised to [0, 1], p_i ~ exp(-c_i / T); T = 0 is
    argmin with a uniform random tie-break. ``rng`` is seeded, so runs are deterministic."""
    lo, hi = min(costs), max(costs)
    if temperature <= 0.0:
        tied = [k for k, c in enumerate(costs) if c == lo]
        return tied[0] if len(tied) == 1 else rng.choice(tied)
    if hi == lo:
        weights = [1.0] * len(costs)
    else:
        scale = -1.0 / ((hi - lo) * temperature)
        weights = [math.exp(c * scale - lo * scale) for c in costs]
    sample = rng.random() * sum(weights)
    acc = 0.0
    for k, w in enumerate(weights):
        acc += w
        if sample <= acc:
            return k
    return len(costs) - 1


class DynamoKVPolicy(PolicyBase):
    """Dynamo's KV router cost, lowest wins (``router_temperature`` > 0: softmax sampling).

    prefill worker w: raw = (active_prefill_tokens(w) + ISL) / block_size, where
    active_prefill_tokens are the *uncached* prompt tokens of the requests routed to w whose
    prefill has not finished; credit = overlap_score_credit * decay * device_blocks
    + host_cache_hit_weight (0.75) * host_blocks + disk_cache_hit_weight (0.25) * disk_blocks;
    cost = prefill_load_scale * max(raw - credit, 0) + decode_blocks. In disaggregated mode the
    prefill router does not track active blocks (decode_blocks = 0); a colocated worker adds its
    decode blocks. decay = 1 / (1 + overlap_score_credit_decay * excess / request_blocks), excess
    = active prefill blocks above the least-loaded worker's (decay 0 = off, the default).

    decode router (P/D): overlap credit 0, no prefill tracking: cost = active decode blocks
    (prompt blocks of every sequence routed to the worker and not finished; output blocks are
    only tracked with ``--router-track-output-blocks``, off) + the request's blocks.
    """

    name: ClassVar[str] = "dynamo_kv"
    late_decode_binding: ClassVar[bool] = False  # the decode is chosen with the prefill

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        overlap_score_credit_decay: float = 0.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        router_temperature: float = 0.0,
    ) -> None:
        if router_temperature < 0:
            raise ValueError(f"router_temperature must be >= 0, got {router_temperature}")
        self.scale = prefill_load_scale
        self.device_w = overlap_score_credit
        self.decay = overlap_score_credit_decay
        self.host_w = host_cache_hit_weight
        self.disk_w = disk_cache_hit_weight
        self.temperature = router_temperature
        # Uncached prompt tokens of the requests this router placed, per prefill instance; an
        # entry lives while its request is in the instance's prefill queue.
        self._uncached: dict[str, dict[str, int]] = {}

    def active_prefill_tokens(self, inst: InstanceState) -> int:
        """Uncached tokens of the prefills queued on ``inst`` (work this router did not place
        counts in full: its cache hits are unknown)."""
        book = self._uncached.get(inst.id) or {}
        return sum(book.get(rid, w.prompt_tokens) for rid, w in inst.prefill_queue.items())

    def _prune(self, cands: list[InstanceState]) -> None:
        """Forget requests that left the queue (prefilled) or never entered it (rejected).
        Runs before a placement, when the previous one has been dispatched or refused."""
        for inst in cands:
            book = self._uncached.get(inst.id)
            if book:
                for rid in [r for r in book if r not in inst.prefill_queue]:
                    del book[rid]

    @staticmethod
    def active_decode_blocks(inst: InstanceState, block_size: int) -> int:
        seqs = (*inst.incoming.values(), *inst.running.values())
        return sum(blocks(w.prompt_tokens, block_size) for w in seqs)

    def prefill_costs(self, ctx: PlacementContext) -> list[float]:
        bs = ctx.block_size
        isl = ctx.request.prompt_tokens
        req_blocks = max(blocks(isl, bs), 1)
        match = ctx.match
        cands = ctx.prefill_candidates
        active = [self.active_prefill_tokens(i) for i in cands]
        floor = min(active)
        costs = []
        for inst, act in zip(cands, active, strict=True):
            gpu = match.gpu_blocks.get(inst.id, 0)
            local = match.local_blocks.get(inst.id, 0)
            disk = max(match.store_blocks - local, 0)
            decay = 1.0
            if self.decay > 0:
                decay = 1.0 / (1.0 + self.decay * ((act - floor) / bs) / req_blocks)
            credit = self.device_w * decay * gpu + self.host_w * (local - gpu) + self.disk_w * disk
            raw = (act + isl) / bs
            cost = self.scale * max(raw - credit, 0.0)
            if inst.does_decode:  # colocated: the worker also decodes
                cost += self.active_decode_blocks(inst, bs) + req_blocks
            costs.append(cost)
        return costs

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        self._prune(cands)
        chosen = cands[softmax_pick(self.prefill_costs(ctx), self.temperature, ctx.rng)]
        option = ctx.estimator.local(chosen)
        uncached = max(ctx.request.prompt_tokens - option.cached_tokens, 0)
        self._uncached.setdefault(chosen.id, {})[ctx.request.request_id] = uncached
        return option

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        cands = ctx.decode_candidates
        if not cands:
            return None
        bs = ctx.block_size
        req_blocks = blocks(ctx.request.prompt_tokens, bs)
        costs = [float(self.active_decode_blocks(i, bs) + req_blocks) for i in cands]
        return cands[softmax_pick(costs, self.temperature, ctx.rng)]
