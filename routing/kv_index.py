"""Which instance holds which KV block on which tier, and every instance's cached prefix at once.

Layout. Each instance owns a *slot* ``s >= 1``; per block the table keeps one int whose bit
``2s`` says "instance s holds it on GPU" and bit ``2s + 1`` "on GPU or host" (local). Bit 1
(slot 0's local bit) is the shared store. ``match`` walks the prompt's blocks once with an
``alive`` mask (``alive &= holders``); when a bit drops out at block ``i`` that holder's prefix
is ``i`` blocks. Cost is O(prefix + instances), not O(blocks x instances), and the walk stops
as soon as nobody is alive. Interleaving the bits (rather than two masks) means one dict lookup
and one AND per block, and slots never need re-laying out as instances come and go.

Per instance an ``OrderedDict`` per tier is the LRU (last = most recent), mirroring the
engine's eviction so that the index stays bounded by the configured capacities. Blocks nobody
holds any more are deleted from the table.

Recency within one call: the engine frees a request's blocks tail first (vLLM's reverse-order
free), so a prompt's *first* blocks are its most recently used. Calls that add or touch a
prompt's blocks therefore touch them last-to-first: when a prompt is longer than the capacity,
its tail is evicted (or demoted) and its prefix, the reusable part, survives.

Predict-on-route: ``record_route`` adds the blocks an instance is about to compute before any
engine event says so. With a TTL these entries are *predicted* until a ``BlockStored`` confirms
them and vanish (from every tier of that instance) at expiry; re-routing does not extend them,
so an unconfirmed belief cannot keep itself alive by attracting more traffic.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from routing.types import (
    EMPTY_MATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefixMatch,
    Tier,
)

_STORE_BIT = 0b10  # slot 0's local bit; slot 0's GPU bit (0b01) is never set


class _Instance:
    __slots__ = ("gpu", "gpu_bit", "gpu_cap", "host", "host_cap", "id", "local_bit", "pred", "slot")

    def __init__(self, instance_id: str, slot: int, gpu_cap: int, host_cap: int) -> None:
        self.id = instance_id
        self.slot = slot
        self.gpu_bit = 1 << (2 * slot)
        self.local_bit = 1 << (2 * slot + 1)
        self.gpu_cap = gpu_cap
        self.host_cap = host_cap
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.pred: dict[int, float] = {}  # unconfirmed block -> expiry time


class KVIndex:
    __slots__ = (
        "_by_slot",
        "_free_slots",
        "_heap",
        "_instances",
        "_seq",
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
        self._instances: dict[str, _Instance] = {}  # registration order
        self._by_slot: dict[int, _Instance] = {}
        self._free_slots: list[int] = []  # heap: reuse the lowest slot to keep masks short
        self._table: dict[int, int] = {}  # block hash -> holder bits (see module docstring)
        self._store: set[int] = set()
        # (expiry, seq, instance, blocks): one entry per routed prompt, not per block.
        self._heap: list[tuple[float, int, _Instance, tuple[int, ...]]] = []
        self._seq = itertools.count()

    # --- instances -------------------------------------------------------------------------

    def add_instance(
        self, instance_id: str, gpu_capacity_blocks: int, host_capacity_blocks: int = 0
    ) -> None:
        if instance_id in self._instances:
            raise ValueError(f"instance {instance_id!r} is already in the KV index")
        if gpu_capacity_blocks < 0 or host_capacity_blocks < 0:
            raise ValueError("capacities must be >= 0")
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._by_slot) + 1
        inst = _Instance(instance_id, slot, gpu_capacity_blocks, host_capacity_blocks)
        self._instances[instance_id] = inst
        self._by_slot[slot] = inst

    def remove_instance(self, instance_id: str) -> None:
        inst = self._instances.pop(instance_id)  # KeyError for an unknown id
        self._clear(inst)
        del self._by_slot[inst.slot]
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
        get = self._table.get
        # -1 = every bit. The first block's AND makes it finite; nothing is recorded for bits
        # that drop out there (a zero-length prefix is no prefix).
        alive = -1
        drops: list[tuple[int, int]] = []  # (bits that dropped out, prefix length)
        n = 0
        for h in block_hashes:
            held = get(h)
            if held is None:  # nobody holds it: everyone alive stops here
                break
            still = alive & held
            if still != alive:
                if n:
                    drops.append((alive ^ still, n))
                if not still:
                    alive = 0
                    break
                alive = still
            n += 1
        else:
            if alive == -1:  # empty prompt
                return EMPTY_MATCH
        if alive and n:
            drops.append((alive, n))
        if not drops:
            return EMPTY_MATCH
        return self._result(drops)

    def _result(self, drops: list[tuple[int, int]]) -> PrefixMatch:
        gpu_len: dict[int, int] = {}
        local_len: dict[int, int] = {}
        store = 0
        for bits, length in drops:
            while bits:
                low = bits & -bits
                bits ^= low
                pos = low.bit_length() - 1
                if pos & 1:
                    if pos == 1:
                        store = length
                    else:
                        local_len[pos >> 1] = length
                else:
                    gpu_len[pos >> 1] = length
        gpu_blocks: dict[str, int] = {}
        local_blocks: dict[str, int] = {}
        best = max(local_len.values(), default=0)
        holders: list[str] = []
        for iid, inst in self._instances.items():  # registration order
            loc = local_len.get(inst.slot)
            if loc is None:
                continue
            local_blocks[iid] = loc
            if loc == best:
                holders.append(iid)
            g = gpu_len.get(inst.slot)
            if g is not None:
                gpu_blocks[iid] = g
        return PrefixMatch(gpu_blocks, local_blocks, store, best, tuple(holders))

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

    def record_route(self, instance_id: str, block_hashes: Sequence[int], now: float) -> None:
        """The gateway sent this prompt to the instance: predict that it will cache the blocks.

        A no-op for an instance that is not (or no longer) registered.
        """
        if self._heap and self._heap[0][0] <= now:
            self.expire(now)
        inst = self._instances.get(instance_id)
        if inst is None or not block_hashes:
            return
        ttl = self.predicted_ttl_s
        new = self._add_gpu(inst, block_hashes, predicted=ttl is not None)
        if new and ttl is not None:
            expiry = now + ttl
            pred = inst.pred
            for h in new:
                pred[h] = expiry
            heapq.heappush(self._heap, (expiry, next(self._seq), inst, tuple(new)))
        self._evict(inst)

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
            self._clear(inst)
            return
        if event.tier is Tier.STORE:  # an instance writing to / dropping from the shared store
            self.apply_store(event)
            return
        pred = inst.pred
        if isinstance(event, BlockStored):
            if event.tier is Tier.GPU:
                self._add_gpu(inst, event.block_hashes, predicted=False)
            else:
                self._add_host(inst, reversed(event.block_hashes))
            for h in event.block_hashes:
                pred.pop(h, None)  # confirmed: no expiry any more
            self._evict(inst)
        elif isinstance(event, BlockRemoved):
            tier = inst.gpu if event.tier is Tier.GPU else inst.host
            for h in event.block_hashes:
                if h in tier:
                    self._drop(inst, h, event.tier)

    def apply_store(self, event: KVEvent) -> None:
        """An event of the shared store tier (global, unbounded: the store reports removals)."""
        table, store = self._table, self._store
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                if h not in store:
                    store.add(h)
                    table[h] = table.get(h, 0) | _STORE_BIT
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if h in store:
                    store.discard(h)
                    self._unset(h, _STORE_BIT)
        elif isinstance(event, AllBlocksCleared):
            for h in list(store):
                self._unset(h, _STORE_BIT)
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
                        self._drop(inst, h, Tier.GPU)
                    if h in inst.host:
                        self._drop(inst, h, Tier.HOST)
                    removed += 1
        return removed

    # --- internals -------------------------------------------------------------------------

    def _add_gpu(self, inst: _Instance, blocks: Sequence[int], predicted: bool) -> list[int]:
        """Add or touch blocks on GPU, last-to-first; returns those the instance did not hold."""
        table, gpu, host = self._table, inst.gpu, inst.host
        both = inst.gpu_bit | inst.local_bit
        new: list[int] = []
        for h in reversed(blocks):
            if h in gpu:
                gpu.move_to_end(h)
                continue
            gpu[h] = None
            table[h] = table.get(h, 0) | both
            if h in host:  # loaded back from host: keeps its host copy (and its status)
                host.move_to_end(h)
            elif predicted:
                new.append(h)
        return new

    def _add_host(self, inst: _Instance, blocks: Iterable[int]) -> None:
        table, host = self._table, inst.host
        for h in blocks:
            if h in host:
                host.move_to_end(h)
            else:
                host[h] = None
                table[h] = table.get(h, 0) | inst.local_bit

    def _evict(self, inst: _Instance) -> None:
        """LRU-evict beyond capacity; GPU victims are demoted to host when there is one."""
        gpu, host = inst.gpu, inst.host
        excess = len(gpu) - inst.gpu_cap
        if excess > 0:
            victims = [gpu.popitem(last=False)[0] for _ in range(excess)]
            table, gbit = self._table, inst.gpu_bit
            for h in victims:
                table[h] &= ~gbit  # still local: host copy or demotion below, else dropped
            if inst.host_cap:
                self._add_host(inst, victims)
            else:
                for h in victims:
                    if h not in host:
                        self._gone(inst, h)
        excess = len(host) - inst.host_cap
        for _ in range(excess):
            h = host.popitem(last=False)[0]
            if h not in gpu:
                self._gone(inst, h)

    def _drop(self, inst: _Instance, h: int, tier: Tier) -> None:
        """Remove a block the instance holds on ``tier`` (GPU or HOST)."""
        if tier is Tier.GPU:
            del inst.gpu[h]
            self._table[h] &= ~inst.gpu_bit
            if h not in inst.host:
                self._gone(inst, h)
        else:
            del inst.host[h]
            if h not in inst.gpu:
                self._gone(inst, h)

    def _gone(self, inst: _Instance, h: int) -> None:
        """The instance holds the block on no tier any more."""
        inst.pred.pop(h, None)
        self._unset(h, inst.local_bit | inst.gpu_bit)

    def _unset(self, h: int, bits: int) -> None:
        table = self._table
        left = table[h] & ~bits
        if left:
            table[h] = left
        else:
            del table[h]  # nobody holds it: keep the table bounded

    def _clear(self, inst: _Instance) -> None:
        bits = inst.gpu_bit | inst.local_bit
        for h in inst.gpu:
            self._unset(h, bits)
        for h in inst.host:
            if h not in inst.gpu:
                self._unset(h, bits)
        inst.gpu.clear()
        inst.host.clear()
        inst.pred.clear()
