"""A router-side approximate prefix index: what the router itself sent where, not the engines'
real caches.

SGLang/SMG's ``cache_aware`` (HTTP mode: a radix tree of routed prompt text per worker) and
GIE/llm-d's ``prefix-cache-scorer`` (approximate mode: an LRU of chained block hashes per
server) both learn only from their own routing decisions. They never see an engine evict a
block, so they keep routing a prefix to the worker that held it long after it was evicted. Both
are modelled here at the trace's block granularity (the trace's block ids are chained, like the
peers' hashes): a per-instance LRU of block ids with an entry limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class RouterPrefixIndex:
    """Per-instance LRU of routed block ids; ``match`` is the leading-prefix length."""

    __slots__ = ("_lru", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, instance_id: str, blocks: Sequence[int]) -> int:
        """Consecutive leading blocks of ``blocks`` this router has sent to the instance."""
        lru = self._lru.get(instance_id)
        if not lru:
            return 0
        n = 0
        for b in blocks:
            if b not in lru:
                break
            n += 1
        return n

    def insert(self, instance_id: str, blocks: Iterable[int]) -> None:
        """Record a route (touching the blocks); evict least recently used beyond capacity."""
        lru = self._lru.setdefault(instance_id, OrderedDict())
        for b in blocks:
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)

    def size(self, instance_id: str) -> int:
        lru = self._lru.get(instance_id)
        return len(lru) if lru else 0
