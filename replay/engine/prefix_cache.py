"""An engine's block-level prefix cache: LRU over blocks, bounded by KV capacity.

Lookup returns the longest cached prefix; insertion evicts least-recently-used blocks. Every
change is reported as a KV event (what vLLM publishes over ZMQ), so the Conductor's KV index
can follow the engine exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from routing.types import BlockRemoved, BlockStored, KVEvent


class PrefixCache:
    __slots__ = ("_blocks", "capacity_blocks", "events", "hits", "lookups")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.events: list[KVEvent] = []
        self.hits = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks held; touches them (a hit makes them recently used)."""
        n = 0
        cache = self._blocks
        for b in blocks:
            if b not in cache:
                break
            cache.move_to_end(b)
            n += 1
        self.lookups += len(blocks)
        self.hits += n
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        cache = self._blocks
        stored = []
        for b in blocks:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                stored.append(b)
        if stored:
            self.events.append(BlockStored(tuple(stored)))
        over = len(cache) - self.capacity_blocks
        if over > 0:
            # Evict LRU blocks, but never the ones of the prompt just inserted: they are the
            # most recent, so once the oldest block is one of them only they are left. (Popping
            # from the old end is O(1) a block; a scan of the whole cache took a third of a
            # simulation's time.)
            keep = set(blocks)
            removed = []
            while over > 0:
                oldest = next(iter(cache))
                if oldest in keep:
                    break
                del cache[oldest]
                removed.append(oldest)
                over -= 1
            if removed:
                self.events.append(BlockRemoved(tuple(removed)))

    def drain_events(self) -> list[KVEvent]:
        ev, self.events = self.events, []
        return ev
