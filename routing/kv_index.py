"""Which instance holds which KV block on which tier, and every instance's cached prefix at once.

The block table maps a block hash to one int of holder bits: two per instance (GPU; GPU or
host) and one for the shared store (layout and the per-instance LRUs: routing/kv_holdings.py).
``match`` walks the prompt's blocks once with an ``alive`` mask (``alive &= holders``); when a
bit drops out at block ``i`` that holder's prefix is ``i`` blocks (decoded in
routing/kv_match.py). Cost is O(prefix + instances), not O(blocks x instances), and the walk
stops as soon as nobody is alive.

Recency within one call: the engine frees a request's blocks tail first (vLLM's reverse-order
free), so a prompt's *first* blocks are its most recently used. Calls that add or touch a
prompt's blocks therefore touch them last-to-first: when a prompt is longer than the capacity,
its tail is evicted (or demoted) and its prefix, the reusable part, survives.

Predict-on-route: ``record_route`` adds the blocks an instance is about to compute before any
engine event says so. With a TTL these entries are *predicted* until a ``BlockStored`` confirms
them and vanish (from every tier of that instance) at expiry; re-routing does not extend them,
so an unconfirmed belief cannot keep itself alive by attracting more traffic. Engines without
KV events confirm through their answers (``settle``: what the engine reported cached, and
the prompt it just computed); a route the engine refused is taken back (``forget_route``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from routing.kv_holdings import K_BOTH, K_GPU, K_LOCAL, K_STORE, STORE_BIT, Holdings, unset
from routing.kv_match import decode_drops
from routing.types import (
    EMPTY_MATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefixMatch,
    Tier,
)


class KVIndex:
    """KV block holdings of every instance (GPU, host) and of the shared store.

    ``match`` is a query (no LRU effect); ``record_route``, ``touch`` and ``apply`` update.
    Every call that takes ``now`` first drops predicted entries expired by then. Instance ids
    unknown to the index are ignored by ``record_route`` / ``touch`` and counted by ``apply``.
    Memory: each instance holds at most its capacities, and the block table only blocks that
    somebody holds, so ``len(index) <= sum of capacities + store blocks``.
    """

    __slots__ = (
        "_free_slots",
        "_heap",
        "_instances",
        "_owner",
        "_seq",
        "_slot_masks",
        "_store",
        "_table",
        "predicted_ttl_s",
        "unknown_instance_events",
    )

    def __init__(self, predicted_ttl_s: float | None = None) -> None:
        if predicted_ttl_s is not None and not predicted_ttl_s > 0:
            raise ValueError(f"predicted_ttl_s must be > 0 or None, got {predicted_ttl_s!r}")
        self.predicted_ttl_s = predicted_ttl_s
        self.unknown_instance_events = 0
        self._instances: dict[str, Holdings] = {}  # registration order
        self._slot_masks: list[int] = [0b11]  # slot -> its two bits (slot 0: the store)
        self._free_slots: list[int] = []  # heap: reuse the lowest slot to keep masks short
        # Bits -> (instance id, _K_* kind) for one slot's GPU bit, local bit, or both, and the
        # store bit: decodes a drop point with one lookup.
        self._owner: dict[int, tuple[str, int]] = {STORE_BIT: ("", K_STORE)}
        self._table: dict[int, int] = {}  # block hash -> holder bits (see module docstring)
        self._store: set[int] = set()
        # (expiry, seq, instance, blocks): one entry per routed prompt, not per block.
        self._heap: list[tuple[float, int, Holdings, tuple[int, ...]]] = []
        self._seq = itertools.count()

    # --- instances -------------------------------------------------------------------------

    def add_instance(
        self, instance_id: str, gpu_capacity_blocks: int, host_capacity_blocks: int = 0
    ) -> None:
        if instance_id in self._instances:
            raise ValueError(f"instance {instance_id!r} is already in the KV index")
        if gpu_capacity_blocks < 0 or host_capacity_blocks < 0:
            raise ValueError("capacities must be >= 0")
        masks = self._slot_masks
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(masks)
        order = next(self._seq)
        inst = Holdings(instance_id, order, slot, gpu_capacity_blocks, host_capacity_blocks)
        self._instances[instance_id] = inst
        if slot == len(masks):
            masks.append(0b11 << 2 * slot)
        owner = self._owner
        owner[inst.gpu_bit] = (instance_id, K_GPU)
        owner[inst.local_bit] = (instance_id, K_LOCAL)
        owner[inst.gpu_bit | inst.local_bit] = (instance_id, K_BOTH)

    def remove_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id)  # KeyError for an unknown id
        inst.clear(self._table)
        for bits in (inst.gpu_bit, inst.local_bit, inst.gpu_bit | inst.local_bit):
            del self._owner[bits]
        heapq.heappush(self._free_slots, inst.slot)

    def instances(self) -> tuple[str, ...]:
        return tuple(self._instances)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances

    # --- queries ---------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[int], now: float) -> PrefixMatch:
        """Longest cached prefix of ``block_hashes`` on every instance and in the store."""
        heap = self._heap
        if heap and heap[0][0] <= now:
            self.expire(now)  # drops only what is already invalid: no visible state change
        # -1 = every bit. The first block's AND makes it finite; nothing is recorded for bits
        # that drop out there (a zero-length prefix is no prefix).
        alive = -1
        prev = 0  # never a table value (empty masks are deleted), so block 0 is always checked
        drops: list[tuple[int, int]] = []  # (bits that dropped out, prefix length)
        n = 0
        # map() does the lookups in C; runs of blocks with the same holders (a shared system
        # prompt, one instance's private suffix) cost one equality test per block.
        for n, held in enumerate(map(self._table.get, block_hashes)):
            if held == prev:
                continue
            if held is None:  # nobody holds it: everyone alive stops here
                break
            prev = held
            still = alive & held
            if still != alive:
                if n:
                    drops.append((alive ^ still, n))
                if not still:
                    return self._result(drops) if drops else EMPTY_MATCH
                alive = still
        else:
            if alive == -1:  # empty prompt
                return EMPTY_MATCH
            n = len(block_hashes)
        if n:
            drops.append((alive, n))
        return self._result(drops) if drops else EMPTY_MATCH

    def _result(self, drops: list[tuple[int, int]]) -> PrefixMatch:
        instances = self._instances
        return decode_drops(drops, self._owner, self._slot_masks, lambda i: instances[i].order)

    def holds(self, instance_id: str, block_hash: int, tier: Tier | None = None) -> bool:
        """Whether the instance holds the block on ``tier`` (None: GPU or host; STORE: global)."""
        if tier is Tier.STORE:
            return block_hash in self._store
        inst = self._instances.get(instance_id)
        if inst is None:
            return False
        if tier is Tier.GPU:
            return block_hash in inst.gpu
        if tier is Tier.HOST:
            return block_hash in inst.host
        return block_hash in inst.gpu or block_hash in inst.host

    def is_predicted(self, instance_id: str, block_hash: int) -> bool:
        inst = self._instances.get(instance_id)
        return inst is not None and block_hash in inst.pred

    def blocks_held(self, instance_id: str) -> tuple[int, int]:
        inst = self._instances[instance_id]
        return len(inst.gpu), len(inst.host)

    def store_blocks(self) -> int:
        return len(self._store)

    def __len__(self) -> int:
        return len(self._table)

    # --- updates ---------------------------------------------------------------------------

    def record_route(
        self, instance_id: str, block_hashes: Sequence[int], now: float
    ) -> tuple[int, ...]:
        """The gateway sent this prompt to the instance: predict that it will cache the blocks.

        Returns the blocks the instance did not hold before (what ``forget_route`` takes back
        if the engine never computes the prompt). A no-op for an unregistered instance.
        """
        if self._heap and self._heap[0][0] <= now:
            self.expire(now)
        inst = self._instances.get(instance_id)
        if inst is None or not block_hashes:
            return ()
        ttl = self.predicted_ttl_s
        new = inst.add_gpu(self._table, block_hashes, predicted=True)
        if new and ttl is not None:
            expiry = now + ttl
            pred = inst.pred
            for h in new:
                pred[h] = expiry
            heapq.heappush(self._heap, (expiry, next(self._seq), inst, tuple(new)))
        inst.evict(self._table)
        return tuple(new)

    def forget_route(self, instance_id: str, added: Sequence[int]) -> int:
        """The engine refused or lost a routed prompt before computing it: drop the blocks its
        route added (``record_route``'s result) that no engine event confirmed since (without
        a TTL nothing is marked unconfirmed: all of them). Returns how many were dropped."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return 0
        pred, gpu, host = inst.pred, inst.gpu, inst.host
        unconfirmed_only = self.predicted_ttl_s is not None
        dropped = 0
        for h in added:
            if unconfirmed_only and h not in pred:
                continue
            if h in gpu:
                inst.drop(self._table, h, Tier.GPU)
            if h in host:
                inst.drop(self._table, h, Tier.HOST)
            pred.pop(h, None)
            dropped += 1
        return dropped

    def settle(
        self,
        instance_id: str,
        block_hashes: Sequence[int],
        missed_blocks: int,
        now: float,
        extra_blocks: int = 0,
    ) -> int:
        """The engine answered a prompt: it now caches the prompt's full blocks (confirmed,
        most recently used). ``missed_blocks``: how many blocks this index believed the
        instance held for the prompt but the engine reported not cached. The engine evicted
        them, and with LRU eviction everything used less recently went first, so that many of
        the instance's least recently used blocks are dropped too, and the instance's capacity
        is taken to be what is left: an engine keeps less than its stated capacity when it
        caches whole prompts per slot (llama.cpp). ``extra_blocks``: the engine had that many
        more than this index believed, so the capacity grows back (up to the stated one).
        Returns how many blocks were dropped."""
        inst = self._instances.get(instance_id)
        if inst is None or not block_hashes:
            return 0
        if self._heap and self._heap[0][0] <= now:
            self.expire(now)
        # _add_gpu and the confirmation in one pass (this runs for every answered request).
        table, gpu, host, pred_pop = self._table, inst.gpu, inst.host, inst.pred.pop
        both = inst.gpu_bit | inst.local_bit
        for h in reversed(block_hashes):
            if h in gpu:
                gpu.move_to_end(h)
            else:
                gpu[h] = None
                table[h] = table.get(h, 0) | both
                if h in host:
                    host.move_to_end(h)
            pred_pop(h, None)
        if missed_blocks <= 0:
            if extra_blocks > 0:
                inst.gpu_cap = min(inst.gpu_cap + extra_blocks, inst.max_gpu_cap)
            inst.evict(self._table)
            return 0
        inst.evict(self._table)
        # The prompt's blocks are the most recent now: the oldest ones before them go.
        mine = set(block_hashes)
        older = itertools.takewhile(lambda h: h not in mine, inst.gpu)
        victims = list(itertools.islice(older, missed_blocks))
        for h in victims:
            inst.drop(self._table, h, Tier.GPU)
        inst.gpu_cap = min(max(len(inst.gpu), len(mine)), inst.max_gpu_cap)
        return len(victims)

    def set_capacity(self, instance_id: str, gpu_capacity_blocks: int) -> None:
        """The engine stated its KV capacity: bound the instance's GPU tier by it."""
        if gpu_capacity_blocks < 0:
            raise ValueError("capacities must be >= 0")
        inst = self._instances[instance_id]  # KeyError for an unknown id
        inst.gpu_cap = inst.max_gpu_cap = gpu_capacity_blocks
        inst.evict(self._table)

    def touch(self, instance_id: str, block_hashes: Sequence[int]) -> None:
        """Mark held blocks most recently used (prefix first, see module docstring)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        gpu, host = inst.gpu, inst.host
        for h in reversed(block_hashes):
            if h in gpu:
                gpu.move_to_end(h)
            if h in host:
                host.move_to_end(h)

    def apply(self, instance_id: str, event: KVEvent, now: float) -> None:
        """An engine KV event (the source of truth; capacities still bound the index)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            self.unknown_instance_events += 1
            return
        if self._heap and self._heap[0][0] <= now:
            self.expire(now)
        if isinstance(event, AllBlocksCleared):
            inst.clear(self._table)
            return
        if event.tier is Tier.STORE:  # an instance writing to / dropping from the shared store
            self.apply_store(event)
            return
        pred = inst.pred
        if isinstance(event, BlockStored):
            if event.tier is Tier.GPU:
                inst.add_gpu(self._table, event.block_hashes, predicted=False)
            else:
                inst.add_host(self._table, reversed(event.block_hashes))
            for h in event.block_hashes:
                pred.pop(h, None)  # confirmed: no expiry any more
            inst.evict(self._table)
        elif isinstance(event, BlockRemoved):
            tier = inst.gpu if event.tier is Tier.GPU else inst.host
            for h in event.block_hashes:
                if h in tier:
                    inst.drop(self._table, h, event.tier)

    def apply_store(self, event: KVEvent) -> None:
        """An event of the shared store tier (global, unbounded: the store reports removals)."""
        table, store = self._table, self._store
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                if h not in store:
                    store.add(h)
                    table[h] = table.get(h, 0) | STORE_BIT
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if h in store:
                    store.discard(h)
                    unset(table, h, STORE_BIT)
        elif isinstance(event, AllBlocksCleared):
            for h in list(store):
                unset(table, h, STORE_BIT)
            store.clear()

    def expire(self, now: float) -> int:
        """Remove predicted entries whose expiry is ``<= now``; returns how many."""
        heap, instances = self._heap, self._instances
        removed = 0
        while heap and heap[0][0] <= now:
            expiry, _, inst, blocks = heapq.heappop(heap)
            if instances.get(inst.id) is not inst:  # instance removed (maybe re-added) since
                continue
            pred = inst.pred
            for h in blocks:
                # Another expiry means the block left and was predicted again later.
                if pred.get(h) == expiry:
                    if h in inst.gpu:
                        inst.drop(self._table, h, Tier.GPU)
                    if h in inst.host:
                        inst.drop(self._table, h, Tier.HOST)
                    removed += 1
        return removed
