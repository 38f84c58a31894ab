"""llm-d / Gateway API Inference Extension EPP: the default scheduling profile.

Source: kubernetes-sigs/gateway-api-inference-extension ``pkg/epp/config/loader/defaults.go``
(profile weights), ``pkg/epp/scheduling/framework/plugins/scorer/{queue,kvcache_utilization}.go``
and ``.../multi/prefix/plugin.go`` (approximate prefix index: ``DefaultBlockSizeTokens`` 16,
``DefaultMaxPrefixBlocks`` 256, ``DefaultLRUCapacityPerServer`` 31250 or the engine's GPU blocks
with autoTune), read at ``a70292c1^`` (2026-06); the same plugins continue in
llm-d/llm-d-inference-scheduler ``pkg/epp`` (``520af478``). Audit notes: docs/peer-fidelity.md.
"""

from __future__ import annotations

from typing import ClassVar

from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, PolicyBase
from routing.policies.router_prefix import RouterPrefixIndex


def minmax_scores(values: list[float]) -> list[float]:
    """GIE queue-scorer: (max - v) / (max - min); all equal -> 1."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [(hi - v) / (hi - lo) for v in values]


def max_score_pick(cands: list[InstanceState], scores: list[float], ctx: PlacementContext):
    """``max-score-picker``: the best score, a uniformly random one among ties."""
    top = max(scores)
    tied = [c for c, s in zip(cands, scores, strict=True) if s >= top - 1e-12]
    return tied[0] if len(tied) == 1 else ctx.rng.choice(tied)


class EngineMetrics:
    """What the EPP's data layer scraped: per instance (waiting requests, KV usage), refreshed
    every ``interval_s`` of simulated time (0 = always fresh). Requests arriving within one
    interval see the same numbers, as on a real EPP."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._at: float | None = None
        self._values: dict[str, tuple[float, float]] = {}

    def get(self, cands: list[InstanceState], now: float) -> list[tuple[float, float]]:
        stale = self._at is None or now - self._at >= self.interval_s
        if stale or any(i.id not in self._values for i in cands):
            self._at = now
            self._values = {i.id: scrape(i) for i in cands}
        return [self._values[i.id] for i in cands]


def scrape(inst: InstanceState) -> tuple[float, float]:
    """vLLM's ``num_requests_waiting`` and ``kv_cache_usage_perc`` of an instance.

    A prefill instance runs the head of its FCFS queue; the rest wait. A decode instance's
    waiting queue is empty while its batch has room (requests still in prefill elsewhere are
    not on the engine yet). KV usage counts running sequences only (cached free blocks are
    free in vLLM)."""
    cap = max(inst.capacity_tokens, 1)
    if inst.role.value == "decode":
        return 0.0, min(inst.context_tokens / cap, 1.0)
    queue = list(inst.prefill_queue.values())
    running = queue[0].prompt_tokens if queue else 0
    waiting = max(len(queue) - 1, 0)
    if inst.does_decode:  # colocated
        return float(waiting), min((running + inst.context_tokens) / cap, 1.0)
    return float(waiting), min(running / cap, 1.0)


class LLMDWeightedPolicy(PolicyBase):
    """GIE default profile: queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer 3,
    max-score picker (random tie-break).

    queue = min-max of waiting requests; kv = 1 - KV usage (both from scraped metrics);
    prefix = matched / hashed blocks in the EPP's own approximate index, which hashes at most
    ``max_prefix_blocks`` x ``hash_block_tokens`` leading tokens (256 x 16 = 4096) and learns
    only from its own routes (PreRequest), LRU per server at the engine's GPU block count.
    Decode pods (P/D decode profile): queue + KV scorers on their own metrics.
    """

    name: ClassVar[str] = "llmd_weighted"
    late_decode_binding: ClassVar[bool] = False  # the decode is chosen with the prefill

    def __init__(
        self,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        prefix_weight: float = 3.0,
        hash_block_tokens: int = 16,
        max_prefix_blocks: int = 256,
        scrape_interval_s: float = 0.05,
    ) -> None:
        self.wq, self.wkv, self.wp = queue_weight, kv_weight, prefix_weight
        self.max_prefix_tokens = hash_block_tokens * max_prefix_blocks
        self.metrics = EngineMetrics(scrape_interval_s)
        self._decode_metrics = EngineMetrics(scrape_interval_s)
        self._index: RouterPrefixIndex | None = None

    def _hashed(self, ctx: PlacementContext) -> tuple[int, ...]:
        limit = max(self.max_prefix_tokens // ctx.block_size, 1)
        return ctx.request.block_hashes[:limit]

    def prefix_scores(self, ctx: PlacementContext) -> list[float]:
        hashes = self._hashed(ctx)
        if self._index is None:
            cap = ctx.prefill_candidates[0].capacity_tokens // ctx.block_size
            self._index = RouterPrefixIndex(max(cap, 1))
        if not hashes:
            return [0.0] * len(ctx.prefill_candidates)
        return [self._index.match(i.id, hashes) / len(hashes) for i in ctx.prefill_candidates]

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        metrics = self.metrics.get(cands, ctx.now)
        q = minmax_scores([m[0] for m in metrics])
        prefix = self.prefix_scores(ctx)
        scores = [
            self.wq * qs + self.wkv * (1.0 - kv) + self.wp * p
            for qs, (_, kv), p in zip(q, metrics, prefix, strict=True)
        ]
        chosen = max_score_pick(cands, scores, ctx)
        assert self._index is not None
        self._index.insert(chosen.id, self._hashed(ctx))
        return ctx.estimator.local(chosen)

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        cands = ctx.decode_candidates
        if not cands:
            return None
        metrics = self._decode_metrics.get(cands, ctx.now)
        q = minmax_scores([m[0] for m in metrics])
        scores = [
            self.wq * qs + self.wkv * (1.0 - kv) for qs, (_, kv) in zip(q, metrics, strict=True)
        ]
        return max_score_pick(cands, scores, ctx)
