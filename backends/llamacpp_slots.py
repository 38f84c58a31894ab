"""Which llama.cpp slot a request goes to (``id_slot``), so that hot prefixes stop thrashing.

llama-server with ``-np N`` keeps, per slot, the KV of the last prompt that slot ran; with the
host prompt cache off (``--cache-ram 0``) that is its whole prefix cache. Left to itself it
gives a request the idle slot with the longest common prefix, else the least recently used idle
slot (tools/server/server-context.cpp ``get_available_slot``, llama-cpp-python 0.3.36). So when
the slot holding a request's prefix is busy, the request lands in another idle slot and
overwrites that slot's prefix: two concurrent requests for one hot system prompt evict a second
prompt on every collision (measured: docs/real-engines.md, "Slot affinity").

A request that names ``id_slot`` waits for that slot instead (the server defers it and hands it
the slot when it frees, ``server_queue::pop_deferred_task``). ``SlotBook`` mirrors each slot's
last prompt (kvgate's block keys) and pins a request to the slot that holds the longest prefix
of it, unless that slot already has ``max_waiting`` requests queued; a request without a useful
match goes to the least recently used idle slot. The blocks a pinned request overwrites and no
other slot holds are returned, so the gateway can drop them from its cache view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class SlotState:
    blocks: tuple[int, ...] = ()  # block keys of the last prompt placed here
    active: int = 0  # requests kvgate sent here that have not finished
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class SlotChoice:
    slot: int
    matched_blocks: int  # leading blocks of the prompt the slot already held
    evicted: tuple[int, ...]  # blocks no slot of the instance holds any more


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class InstanceSlots:
    """One llama-server's slots as kvgate last placed them."""

    slots: list[SlotState]
    min_match_blocks: int = 1
    max_waiting: int = 3  # requests queued behind the running one before spilling to another slot

    def choose(self, blocks: Sequence[int], now: float) -> SlotChoice:
        matches = [_common_prefix(s.blocks, blocks) for s in self.slots]
        best = max(range(len(self.slots)), key=lambda i: (matches[i], -self.slots[i].active))
        idle = [i for i, s in enumerate(self.slots) if s.active == 0]
        crowded = self.slots[best].active > self.max_waiting and bool(idle)
        if matches[best] >= self.min_match_blocks and not crowded:
            pick = best
        elif idle:
            pick = min(idle, key=lambda i: self.slots[i].last_used)
        else:
            pick = min(range(len(self.slots)), key=lambda i: (self.slots[i].active, matches[i]))
        slot = self.slots[pick]
        old = slot.blocks
        kept = matches[pick]
        slot.blocks = tuple(blocks)
        slot.active += 1
        slot.last_used = now
        evicted: tuple[int, ...] = ()
        if len(old) > kept:
            held = {h for i, s in enumerate(self.slots) if i != pick for h in s.blocks}
            held.update(slot.blocks)
            evicted = tuple(h for h in old[kept:] if h not in held)
        return SlotChoice(pick, kept, evicted)

    def release(self, slot: int, now: float) -> None:
        s = self.slots[slot]
        s.active = max(0, s.active - 1)
        s.last_used = now


@dataclass(slots=True)
class SlotBook:
    """Slot choices for every llama.cpp instance, and which request holds which slot."""

    min_match_blocks: int = 1
    max_waiting: int = 3
    instances: dict[str, InstanceSlots] = field(default_factory=dict)
    _held: dict[str, tuple[str, int]] = field(default_factory=dict)  # request -> (instance, slot)

    def set_slots(self, instance_id: str, slots: int) -> None:
        """The engine reports ``slots`` parallel slots (``-np``); a new count starts afresh."""
        cur = self.instances.get(instance_id)
        if slots <= 0 or (cur is not None and len(cur.slots) == slots):
            return
        self.instances[instance_id] = InstanceSlots(
            [SlotState() for _ in range(slots)], self.min_match_blocks, self.max_waiting
        )

    def forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def assign(
        self, request_id: str, instance_id: str, blocks: Sequence[int], now: float
    ) -> SlotChoice | None:
        """The slot for a request placed on ``instance_id``; None when it is not a llama.cpp
        instance with known slots (the engine then picks)."""
        inst = self.instances.get(instance_id)
        if inst is None or request_id in self._held:
            return None
        choice = inst.choose(blocks, now)
        self._held[request_id] = (instance_id, choice.slot)
        return choice

    def release(self, request_id: str, now: float) -> None:
        held = self._held.pop(request_id, None)
        if held is None:
            return
        inst = self.instances.get(held[0])
        if inst is not None and held[1] < len(inst.slots):
            inst.release(held[1], now)

    @property
    def held(self) -> int:
        return len(self._held)
