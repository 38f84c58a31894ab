"""TTFT of placing one request's prefill on a given instance (Mooncake Algorithm 1, lines 5-23).

For an instance with local prefix ``l`` blocks, the best holder's prefix ``b`` blocks and the
shared store's ``s`` blocks:

- local:    TTFT = T_load(host part of l) + T_queue + T_prefill(n, l)
- transfer: TTFT = T_transfer(holder -> instance, b - l) + T_queue + T_prefill(n, b),
            considered when b / l >= kvcache_balancing_threshold (the paper's rule) and the
            remote part is at least ``min_transfer_blocks`` long
- store:    TTFT = T_load_store(s - l) + T_queue + T_prefill(n, s), when s > l (HiCache L3)

The paper evaluates only one branch per instance; we evaluate the local branch always and take
the minimum, so a slow link can never make a choice worse than recomputing.
One estimator is built per request; prefill times are memoised by cached length because most
instances share the same few prefix lengths (the hot path stays arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.instance_books import InstanceState
from routing.llamacpp_slots import SlotBook
from routing.types import PrefixMatch, RequestInfo

STORE_SOURCE = "store"


def cached_tokens(blocks: int, block_size: int, prompt_tokens: int) -> int:
    """Prompt tokens ``blocks`` cached blocks spare the prefill: the engine always computes at
    least the last prompt token."""
    return max(0, min(blocks * block_size, prompt_tokens - 1))


@dataclass(slots=True)
class PrefillOption:
    instance: InstanceState
    ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    load_s: float
    cached_blocks: int  # prefix blocks the prefill reuses (local, pulled or loaded)
    cached_tokens: int
    pull_source: str | None = None  # holder instance id or STORE_SOURCE
    pull_from_block: int = 0  # first block index pulled (the instance's local prefix length)
    # Ranking only, not a TTFT: the recompute of the shared prefix a llama.cpp slot would lose
    # here (routing/llamacpp_slots.py), which the next request for that prefix pays.
    evict_s: float = 0.0

    @property
    def rank_s(self) -> float:
        """What placement minimises: the TTFT plus the eviction it causes."""
        return self.ttft_s + self.evict_s

    @property
    def reason(self) -> str:
        if self.pull_source == STORE_SOURCE:
            return "load_from_store"
        if self.pull_source is not None:
            return "pull_prefix"
        return "local_prefix" if self.cached_blocks else "no_prefix"


class TTFTEstimator:
    __slots__ = (
        "_cache",
        "_holders",
        "_sources",
        "block_size",
        "evict_weight",
        "match",
        "min_transfer_blocks",
        "now",
        "request",
        "setup_s",
        "slots",
        "threshold",
        "transfer_allowed",
    )

    def __init__(
        self,
        request: RequestInfo,
        match: PrefixMatch,
        now: float,
        *,
        block_size: int,
        threshold: float,
        min_transfer_blocks: int,
        holders: dict[str, InstanceState],
        transfer_allowed: bool = True,
        setup_s: dict[str, float] | None = None,
        slots: SlotBook | None = None,
        evict_weight: float = 1.0,
    ) -> None:
        self.request = request
        self.match = match
        self.now = now
        self.block_size = block_size
        self.threshold = threshold
        self.min_transfer_blocks = min_transfer_blocks
        self.transfer_allowed = transfer_allowed
        # Per instance, what it must load before this prefill can run besides KV (a LoRA
        # adapter not in host memory); counted as load, so it is booked as the engine's work.
        self.setup_s = setup_s
        # llama.cpp instances' slots: the shared prefix a placement would overwrite there is
        # charged at ``evict_weight`` times its recompute when options are ranked. Asked only
        # for the instances a policy estimates (none for round_robin, fewer after pruning).
        self.slots = slots
        self.evict_weight = evict_weight
        self._holders = holders
        self._cache: dict[tuple[int, int], float] = {}
        self._sources: list[tuple[float, int, str]] | None = None

    def min_prefill(self, inst: InstanceState) -> float:
        """A lower bound on any option's prefill time: the longest prefix anyone offers."""
        return self.prefill_time(inst, max(self.match.best_blocks, self.match.store_blocks))

    def cached_tokens(self, blocks: int) -> int:
        return cached_tokens(blocks, self.block_size, self.request.prompt_tokens)

    def prefill_time(self, inst: InstanceState, blocks: int) -> float:
        key = (id(inst.predictors), blocks)
        t = self._cache.get(key)
        if t is None:
            cached = self.cached_tokens(blocks)
            t = inst.predictors.prefill.predict(self.request.prompt_tokens - cached, cached)
            self._cache[key] = t
        return t

    def local(self, inst: InstanceState) -> PrefillOption:
        """Recompute what the instance does not hold; load its host-tier part first."""
        match = self.match
        local = match.local_blocks.get(inst.id, 0)
        load = 0.0
        if local:
            host_blocks = local - match.gpu_blocks.get(inst.id, 0)
            if host_blocks > 0:
                load = inst.predictors.host_load.time(host_blocks * self.block_size)
        if self.setup_s:
            load += self.setup_s.get(inst.id, 0.0)
        queue = inst.queue_time(self.now)
        prefill = self.prefill_time(inst, local)
        return PrefillOption(
            inst,
            load + queue + prefill,
            queue,
            prefill,
            0.0,
            load,
            local,
            self.cached_tokens(local),
            evict_s=self.evict_time(inst),
        )

    def evict_time(self, inst: InstanceState) -> float:
        """The recompute of the shared prefix placing here destroys (0 for most engines)."""
        if self.slots is None or self.evict_weight <= 0:
            return 0.0
        lost = self.slots.shared_evictions(inst.id, self.request.block_hashes)
        if not lost:
            return 0.0
        tokens = lost * self.block_size
        return self.evict_weight * inst.predictors.prefill.predict(tokens, 0)

    def best(self, inst: InstanceState) -> PrefillOption:
        """Algorithm 1 for one instance: local, pull from the best holder, or load from store."""
        opt = self.local(inst)
        match = self.match
        local = opt.cached_blocks
        best = match.best_blocks
        if (
            self.transfer_allowed
            and best - local >= self.min_transfer_blocks
            and (local == 0 or best / local >= self.threshold)
        ):
            source = self._pick_source(inst)
            if source is not None:
                tokens = (best - local) * self.block_size
                inflight = max(inst.inbound_bytes, 0.0)
                transfer = inst.predictors.link.time(tokens, inflight) + opt.load_s
                prefill = self.prefill_time(inst, best)
                ttft = transfer + opt.queue_s + prefill
                if ttft < opt.ttft_s:
                    opt = PrefillOption(
                        inst,
                        ttft,
                        opt.queue_s,
                        prefill,
                        transfer,
                        opt.load_s,
                        best,
                        self.cached_tokens(best),
                        source,
                        local,
                        opt.evict_s,
                    )
        store = match.store_blocks
        if store > opt.cached_blocks and store - local >= self.min_transfer_blocks:
            load = inst.predictors.store_load.time((store - local) * self.block_size)
            if opt.pull_source is None:
                load += opt.load_s
            elif self.setup_s:  # a pull's load_s holds the host part this load replaces
                load += self.setup_s.get(inst.id, 0.0)
            prefill = self.prefill_time(inst, store)
            ttft = load + opt.queue_s + prefill
            if ttft < opt.ttft_s:
                opt = PrefillOption(
                    inst,
                    ttft,
                    opt.queue_s,
                    prefill,
                    0.0,
                    load,
                    store,
                    self.cached_tokens(store),
                    STORE_SOURCE,
                    local,
                    opt.evict_s,
                )
        return opt

    def _pick_source(self, dest: InstanceState) -> str | None:
        # Of the instances holding the best prefix, pull from the least busy one; the
        # destination itself never counts. The two best are found once per request.
        if self._sources is None:
            ranked = []
            for hid in self.match.best_holders:
                h = self._holders.get(hid)
                if h is not None and h.healthy:
                    ranked.append((h.queue_time(self.now), h.bit_order, hid))
            ranked.sort()
            self._sources = ranked[:2]
        for _, _, hid in self._sources:
            if hid != dest.id:
                return hid
        return None
