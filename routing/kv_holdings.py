"""One instance's KV holdings in ``KVIndex`` (routing/kv_index.py): its slot's bits in the
shared block table and its per-tier LRUs, kept in step with each other.

Layout. Each instance owns a *slot* ``s >= 1`` (freed slots are reused); per block the table
keeps one int whose bit ``2s`` says "instance s holds it on GPU" and bit ``2s + 1`` "on GPU or
host" (local). Bit 1 (slot 0's local bit) is the shared store. Interleaving GPU / local / store
bits in one int (rather than a GPU mask, a host mask and a store flag) costs one dict lookup per
block in ``match`` and never needs re-laying out as instances come and go.

Per instance an ``OrderedDict`` per tier is the LRU (last = most recent), mirroring the engine's
eviction so that the index stays bounded by the configured capacities. Blocks nobody holds any
more are deleted from the table. Every method here takes the table: the index owns it, an
instance only ever sets and clears its own bits (and the store's, for nobody).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from routing.types import Tier

BlockTable = dict[int, int]  # block hash -> holder bits

STORE_BIT = 0b10  # slot 0's local bit; slot 0's GPU bit (0b01) is never set
# What a set of bits in a drop point means (see kv_match.decode_drops).
K_GPU, K_LOCAL, K_STORE = 1, 2, 4
K_BOTH = K_GPU | K_LOCAL


def unset(table: BlockTable, h: int, bits: int) -> None:
    left = table[h] & ~bits
    if left:
        table[h] = left
    else:
        del table[h]  # nobody holds it: keep the table bounded


@dataclass(slots=True, eq=False)
class Holdings:
    id: str
    order: int  # registration sequence: reported orders follow it
    slot: int
    gpu_cap: int
    host_cap: int
    gpu: OrderedDict[int, None] = field(default_factory=OrderedDict)  # LRU first
    host: OrderedDict[int, None] = field(default_factory=OrderedDict)
    pred: dict[int, float] = field(default_factory=dict)  # unconfirmed block -> expiry
    # The stated GPU capacity; ``gpu_cap`` is what the engine's answers show it really keeps.
    max_gpu_cap: int = field(init=False)
    gpu_bit: int = field(init=False)
    local_bit: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_gpu_cap = self.gpu_cap
        self.gpu_bit = 1 << (2 * self.slot)
        self.local_bit = 1 << (2 * self.slot + 1)

    def add_gpu(self, table: BlockTable, blocks: Sequence[int], predicted: bool) -> list[int]:
        """Add or touch blocks on GPU, last-to-first; with ``predicted``, returns those the
        instance did not hold (on any tier)."""
        gpu, host = self.gpu, self.host
        both = self.gpu_bit | self.local_bit
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

    def add_host(self, table: BlockTable, blocks: Iterable[int]) -> None:
        host = self.host
        for h in blocks:
            if h in host:
                host.move_to_end(h)
            else:
                host[h] = None
                table[h] = table.get(h, 0) | self.local_bit

    def evict(self, table: BlockTable) -> None:
        """LRU-evict beyond capacity; GPU victims are demoted to host when there is one.

        The hot path of every route and event, so the table updates are inlined with the
        masks computed once.
        """
        gpu, host, pred_pop = self.gpu, self.host, self.pred.pop
        keep_local = ~self.gpu_bit
        drop_all = ~(self.gpu_bit | self.local_bit)
        excess = len(gpu) - self.gpu_cap
        if excess > 0:
            popitem = gpu.popitem
            for _ in range(excess):
                h = popitem(False)[0]
                if self.host_cap or h in host:  # demoted, or already has a host copy
                    table[h] &= keep_local
                    if h in host:
                        host.move_to_end(h)
                    else:
                        host[h] = None  # the local bit is already set
                    continue
                pred_pop(h, None)
                left = table[h] & drop_all
                if left:
                    table[h] = left
                else:
                    del table[h]
        excess = len(host) - self.host_cap
        if excess > 0:
            popitem = host.popitem
            for _ in range(excess):
                h = popitem(False)[0]
                if h in gpu:
                    continue
                pred_pop(h, None)
                left = table[h] & drop_all
                if left:
                    table[h] = left
                else:
                    del table[h]

    def drop(self, table: BlockTable, h: int, tier: Tier) -> None:
        """Remove a block the instance holds on ``tier`` (GPU or HOST)."""
        if tier is Tier.GPU:
            del self.gpu[h]
            table[h] &= ~self.gpu_bit
            if h not in self.host:
                self._gone(table, h)
        else:
            del self.host[h]
            if h not in self.gpu:
                self._gone(table, h)

    def _gone(self, table: BlockTable, h: int) -> None:
        """The instance holds the block on no tier any more."""
        self.pred.pop(h, None)
        unset(table, h, self.local_bit | self.gpu_bit)

    def clear(self, table: BlockTable) -> None:
        bits = self.gpu_bit | self.local_bit
        for h in self.gpu:
            unset(table, h, bits)
        for h in self.host:
            if h not in self.gpu:
                unset(table, h, bits)
        self.gpu.clear()
        self.host.clear()
        self.pred.clear()
