"""SGLang router / SMG ``cache_aware`` prefill placement and ``power_of_two`` decode placement.

Source: lightseekorg/smg ``model_gateway/src/policies/cache_aware.rs`` (stored snapshot
``10533210``) and ``policies/power_of_two.rs`` (``1373e8d8``); CLI defaults from
``model_gateway/src/main.rs`` at smg ``73da68ca`` (2026-08-07), as surveyed in
shared/reference/peer-routers.md §1.2. The same rule as sgl-project/sglang ``sgl-router``
after PR #14650 (a miss goes to the least loaded worker, not the smallest tree).
Audit notes: docs/peer-fidelity.md.
"""

from __future__ import annotations

from typing import ClassVar

from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, PolicyBase
from routing.policies.router_prefix import RouterPrefixIndex

# StringTree sizes are in characters; the router does not tokenize HTTP prompts.
CHARS_PER_TOKEN = 4


def inflight(inst: InstanceState) -> int:
    """Router-local in-flight requests on an instance (SMG's per-worker load counter)."""
    return len(inst.prefill_queue) + len(inst.incoming) + len(inst.running)


class SGLangCacheAwarePolicy(PolicyBase):
    """SMG ``cache_aware`` with its CLI defaults (0.3 / 64 / 1.5, max tree 2^26 chars).

    load_i = router-local in-flight requests. Imbalanced when (max - min) > balance_abs and
    max > balance_rel * min: go to the least loaded (first minimum). Otherwise
    ``cache_view="tree"`` (HTTP workers, the common deployment): the worker with the longest
    match in the router's own approximate tree if match_rate = matched / input >
    cache_threshold, else the least loaded. ``cache_view="events"`` (gRPC workers with KV
    events): argmax (overlap blocks, -load, -tree size) among workers with overlap > 0, else the
    least loaded. Either way the prompt is then inserted into the chosen worker's tree (LRU
    evicted to ``max_tree_size`` characters). The KV-usage triggers
    (``--balance/overload-token-usage-threshold``) default to 1.0 = off and are not modelled.

    Decode (P/D): ``power_of_two`` over two distinct random workers, the lower wins (ties: the
    first drawn); compared on the engines' KV-cache tokens from the load monitor's last poll
    (every ``load_check_interval_s``) when both have one, else on router-local in-flight
    counts. The tree's choice among several tenants holding the same matched prefix is not
    modelled: the least loaded of them wins here.
    """

    name: ClassVar[str] = "sglang_cache_aware"
    late_decode_binding: ClassVar[bool] = False  # the decode is chosen with the prefill

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 67_108_864,
        cache_view: str = "tree",
        load_check_interval_s: float = 10.0,
    ) -> None:
        if cache_view not in ("tree", "events"):
            raise ValueError(f"cache_view must be 'tree' or 'events', got {cache_view!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.cache_view = cache_view
        self.load_check_interval_s = load_check_interval_s
        self._tree: RouterPrefixIndex | None = None
        self._usage: dict[str, int] = {}  # decode KV tokens at the last load poll
        self._polled_s: float | None = None

    def _tree_for(self, block_size: int) -> RouterPrefixIndex:
        if self._tree is None:
            blocks = self.max_tree_size // (CHARS_PER_TOKEN * block_size)
            self._tree = RouterPrefixIndex(max(blocks, 1))
        return self._tree

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption:
        cands = ctx.prefill_candidates
        tree = self._tree_for(ctx.block_size)
        blocks = ctx.request.block_hashes
        loads = [inflight(i) for i in cands]
        lo, hi = min(loads), max(loads)
        chosen = cands[loads.index(lo)]  # min_by_key(load): the first minimum
        if not (hi - lo > self.balance_abs and hi > self.balance_rel * lo):
            if self.cache_view == "tree":
                chosen = self._tree_choice(ctx, tree, loads, chosen)
            else:
                chosen = self._event_choice(ctx, tree, loads, chosen)
        tree.insert(chosen.id, blocks)
        return ctx.estimator.local(chosen)

    def _tree_choice(
        self,
        ctx: PlacementContext,
        tree: RouterPrefixIndex,
        loads: list[int],
        least: InstanceState,
    ) -> InstanceState:
        blocks = ctx.request.block_hashes
        best, best_key = None, (0, 0)
        for inst, load in zip(ctx.prefill_candidates, loads, strict=True):
            key = (tree.match(inst.id, blocks), -load)
            if best is None or key > best_key:
                best, best_key = inst, key
        matched = min(best_key[0] * ctx.block_size, ctx.request.prompt_tokens)
        rate = matched / max(ctx.request.prompt_tokens, 1)
        return best if best is not None and rate > self.cache_threshold else least

    def _event_choice(
        self,
        ctx: PlacementContext,
        tree: RouterPrefixIndex,
        loads: list[int],
        least: InstanceState,
    ) -> InstanceState:
        local = ctx.match.local_blocks
        best, best_key = None, (0, 0, 0)
        for inst, load in zip(ctx.prefill_candidates, loads, strict=True):
            overlap = local.get(inst.id, 0)
            if overlap <= 0:
                continue
            key = (overlap, -load, -tree.size(inst.id))
            if best is None or key > best_key:
                best, best_key = inst, key
        return best if best is not None else least

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        cands = ctx.decode_candidates
        if len(cands) < 2:
            return cands[0] if cands else None
        self._poll(cands, ctx.now)
        a, b = ctx.rng.sample(cands, 2)
        ua, ub = self._usage.get(a.id), self._usage.get(b.id)
        if ua is not None and ub is not None:
            return a if ua <= ub else b
        return a if inflight(a) <= inflight(b) else b

    def _poll(self, cands: list[InstanceState], now: float) -> None:
        """The load monitor: engines' KV-cache tokens, refreshed every load_check_interval_s."""
        if self._polled_s is not None and now - self._polled_s < self.load_check_interval_s:
            return
        self._polled_s = now
        self._usage = {i.id: i.context_tokens for i in cands}
