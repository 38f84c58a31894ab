"""Faithful re-implementations of peer routers' placement rules, for side-by-side comparison.

Formulas and defaults: shared/reference/peer-routers.md (SGLang router §1.2, Dynamo §3.2,
llm-d/GIE §2.2). Each uses kvgate's KV index as its cache view (the peers approximate it
with their own trees or KV events) and ships with no SLO-based admission.
"""

from __future__ import annotations

from typing import ClassVar

from routing.cluster import InstanceState
from routing.estimates import PrefillOption
from routing.policies.base import PlacementContext, PolicyBase


def _inflight(inst: InstanceState) -> int:
    return len(inst.prefill_queue) + len(inst.incoming) + len(inst.running)


class SGLangCacheAwarePolicy(PolicyBase):
    """SGLang router ``cache_aware`` (smg ``policies/cache_aware.rs``, CLI defaults).

    Imbalanced when (max load - min load) > balance_abs and max load > balance_rel * min load
    (load = router-local in-flight requests): go to the least loaded. Otherwise go to the
    instance with the longest match if match_rate > cache_threshold, else to the least loaded.
    Decode is chosen independently by ``power_of_two`` (the SGLang P/D docs' decode policy).
    """

    name: ClassVar[str] = "sglang_cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        loads = [len(i.prefill_queue) for i in cands]
        lo, hi = min(loads), max(loads)
        least = cands[loads.index(lo)]
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return ctx.estimator.local(least)
        local = ctx.match.local_blocks
        best, best_key = None, (0, 0)
        for inst, load in zip(cands, loads, strict=True):
            key = (local.get(inst.id, 0), -load)
            if best is None or key > best_key:
                best, best_key = inst, key
        matched = min(best_key[0] * ctx.block_size, ctx.request.prompt_tokens)
        rate = matched / max(ctx.request.prompt_tokens, 1)
        chosen = best if best is not None and rate > self.cache_threshold else least
        return ctx.estimator.local(chosen)

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        cands = ctx.decode_candidates
        if len(cands) < 2:
            return cands[0] if cands else None
        a, b = ctx.rng.sample(cands, 2)
        return a if _inflight(a) <= _inflight(b) else b


class DynamoKVPolicy(PolicyBase):
    """Dynamo KV router cost (docs ``router-concepts.md``, 2026 "linear" form).

    prefill: cost = prefill_load_scale * max(active_prefill_blocks + request_blocks
    - overlap_credit, 0), overlap_credit = 1.0*device + host_weight*host + disk_weight*store
    blocks (decode_blocks not tracked for prefill workers in disaggregated mode).
    decode: cost = active decode blocks + request blocks (no overlap credit). argmin with a
    random tie-break (temperature 0).
    """

    name: ClassVar[str] = "dynamo_kv"

    def __init__(
        self,
        prefill_load_scale: float = 1.0,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
    ) -> None:
        self.scale = prefill_load_scale
        self.device_w = overlap_score_credit
        self.host_w = host_cache_hit_weight
        self.disk_w = disk_cache_hit_weight

    def _blocks(self, tokens: int, block_size: int) -> int:
        return -(-tokens // block_size)

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        bs = ctx.block_size
        req_blocks = self._blocks(ctx.request.prompt_tokens, bs)
        match = ctx.match
        best: list[InstanceState] = []
        best_cost = float("inf")
        for inst in ctx.prefill_candidates:
            gpu = match.gpu_blocks.get(inst.id, 0)
            local = match.local_blocks.get(inst.id, 0)
            store = max(match.store_blocks - local, 0)
            credit = self.device_w * gpu + self.host_w * (local - gpu) + self.disk_w * store
            active = self._blocks(inst.queued_tokens, bs)
            cost = self.scale * max(active + req_blocks - credit, 0.0)
            if cost < best_cost:
                best, best_cost = [inst], cost
            elif cost == best_cost:
                best.append(inst)
        chosen = best[0] if len(best) == 1 else ctx.rng.choice(best)
        return ctx.estimator.local(chosen)

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        bs = ctx.block_size
        req_blocks = self._blocks(ctx.request.prompt_tokens, bs)
        best: list[InstanceState] = []
        best_cost = float("inf")
        for inst in ctx.decode_candidates:
            cost = self._blocks(inst.reserved_tokens, bs) + req_blocks
            if cost < best_cost:
                best, best_cost = [inst], cost
            elif cost == best_cost:
                best.append(inst)
        if not best:
            return None
        return best[0] if len(best) == 1 else ctx.rng.choice(best)


def _minmax_scores(values: list[float]) -> list[float]:
    """GIE queue-scorer: (max - v) / (max - min); all equal -> 1."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


def _max_score_pick(cands: list[InstanceState], scores: list[float], ctx: PlacementContext):
    top = max(scores)
    tied = [c for c, s in zip(cands, scores, strict=True) if s >= top - 1e-12]
    return tied[0] if len(tied) == 1 else ctx.rng.choice(tied)


class LLMDWeightedPolicy(PolicyBase):
    """llm-d / GIE default scheduling profile: queue-scorer 2, kv-cache-utilization 2,
    prefix-cache 3, max-score picker (random tie-break). Decode pods: queue + KV scorers."""

    name: ClassVar[str] = "llmd_weighted"

    def __init__(
        self, queue_weight: float = 2.0, kv_weight: float = 2.0, prefix_weight: float = 3.0
    ) -> None:
        self.wq, self.wkv, self.wp = queue_weight, kv_weight, prefix_weight

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        total_blocks = max(len(ctx.request.block_hashes), 1)
        local = ctx.match.local_blocks
        q = _minmax_scores([float(len(i.prefill_queue)) for i in cands])
        scores = []
        for inst, qs in zip(cands, q, strict=True):
            kv = min(inst.queued_tokens / max(inst.capacity_tokens, 1), 1.0)
            prefix = local.get(inst.id, 0) / total_blocks
            scores.append(self.wq * qs + self.wkv * (1.0 - kv) + self.wp * prefix)
        return ctx.estimator.local(_max_score_pick(cands, scores, ctx))

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        cands = ctx.decode_candidates
        if not cands:
            return None
        q = _minmax_scores([float(len(i.incoming)) for i in cands])
        scores = [
            self.wq * qs + self.wkv * (1.0 - min(i.reserved_tokens / max(i.capacity_tokens, 1), 1))
            for i, qs in zip(cands, q, strict=True)
        ]
        return _max_score_pick(cands, scores, ctx)
