"""Which llama.cpp slot a request goes to (``id_slot``), so that hot prefixes stop thrashing.

llama-server with ``-np N`` keeps, per slot, the KV of the last prompt that slot ran; with the
host prompt cache off (``--cache-ram 0``) that is its whole prefix cache. Left to itself it
gives a request the idle slot with the longest common prefix, else the least recently used idle
slot (tools/server/server-context.cpp ``get_available_slot``, llama-cpp-python 0.3.36). So when
the slot holding a request's prefix is busy, the request lands in another idle slot and
overwrites that slot's prefix: two concurrent requests for one hot system prompt evict a second
prompt on every collision (measured: docs/real-engines.md, "Slot affinity").

An engine with llama-server's host prompt cache on (``--cache-ram``, its default) keeps
prompts outside its slots and is not pinned at all (``SlotBook.host_cached``, filled by a
one-off probe, gateway/host_cache_probes.py).

A request that names ``id_slot`` waits for that slot instead (the server defers it and hands it
the slot when it frees, ``server_queue::pop_deferred_task``). ``SlotBook`` mirrors each slot's
last prompt (kvgate's block keys) and pins a request to the slot that holds the longest prefix
of it, unless that slot already has ``max_waiting`` requests queued; a request without a useful
match goes to the least recently used idle slot. The blocks a pinned request overwrites and no
other slot holds are returned, so the gateway can drop them from its cache view.

The book also tells placement what a request would destroy before it is placed
(``shared_evictions``): the blocks of a prefix known to be shared (a later request reused it,
or found it in some slot of the fleet) that taking an idle slot overwrites and no other slot of
that engine keeps. A placement that minimises TTFT alone spills a hot prompt's repeat into
another engine's idle slot whenever the holder's wait exceeds a recompute, and the prompt that
slot held is then recomputed at its next request (docs/real-engines.md section 3); the Conductor
charges that recompute to the spill when it ranks the options. A prefix a slot file holds
(``stored``, gateway/slot_files.py) is not charged: a restore brings it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.hashing import common_prefix_blocks


@dataclass(slots=True)
class SlotState:
    blocks: tuple[int, ...] = ()  # block keys of the last prompt placed here
    shared: int = 0  # leading blocks of ``blocks`` known to serve more than one request
    active: int = 0  # requests kvgate sent here that have not finished
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class SlotChoice:
    slot: int
    matched_blocks: int  # leading blocks of the prompt the slot already held
    evicted: tuple[int, ...]  # blocks no slot of the instance holds any more


@dataclass(slots=True)
class InstanceSlots:
    """One llama-server's slots as kvgate last placed them."""

    slots: list[SlotState]
    min_match_blocks: int = 1
    max_waiting: int = 3  # requests queued behind the running one before spilling to another slot
    # Block keys a slot file holds (gateway/slot_files.py; the book's set): overwriting a
    # prefix that ends in one costs a restore, not a recompute (keys are chained).
    stored: set[int] = field(default_factory=set)

    def _pick(self, blocks: tuple[int, ...]) -> tuple[int, int]:
        """The slot ``choose`` takes, and how many leading blocks of the prompt it holds: the
        longest match (the least busy of equals) unless more than ``max_waiting`` wait there
        while a slot idles, else the least recently used idle slot, else the shortest queue.
        One pass: placement asks this of every llama.cpp instance for each request."""
        matches: list[int] = []
        best, best_m, best_active = 0, -1, 0
        lru, lru_t = -1, math.inf
        for i, s in enumerate(self.slots):
            m = common_prefix_blocks(s.blocks, blocks)
            matches.append(m)
            if m > best_m or (m == best_m and s.active < best_active):
                best, best_m, best_active = i, m, s.active
            if s.active == 0 and s.last_used < lru_t:
                lru, lru_t = i, s.last_used
        if best_m >= self.min_match_blocks and not (best_active > self.max_waiting and lru >= 0):
            return best, best_m
        if lru >= 0:
            return lru, matches[lru]
        pick = min(range(len(self.slots)), key=lambda i: (self.slots[i].active, matches[i]))
        return pick, matches[pick]

    def _kept_elsewhere(self, pick: int) -> int:
        """Leading blocks of slot ``pick``'s prompt that another slot also holds (keys are
        chained, so a common key means a common prefix)."""
        old = self.slots[pick].blocks
        return max(
            (common_prefix_blocks(s.blocks, old) for i, s in enumerate(self.slots) if i != pick),
            default=0,
        )

    def shared_evictions(self, blocks: tuple[int, ...]) -> int:
        """Blocks of a shared prefix that placing ``blocks`` here would overwrite and no other
        slot keeps; nothing changes."""
        if not any(s.shared for s in self.slots):
            return 0
        pick, kept = self._pick(blocks)
        shared = min(self.slots[pick].shared, len(self.slots[pick].blocks))
        if shared <= kept or self.slots[pick].blocks[shared - 1] in self.stored:
            return 0
        return max(0, shared - max(kept, self._kept_elsewhere(pick)))

    def note_shared(self, blocks: tuple[int, ...]) -> int:
        """A request with ``blocks`` is being placed in the fleet: the prefix any slot here has
        in common with it now serves two requests. Returns the longest such prefix."""
        longest = 0
        for s in self.slots:
            m = common_prefix_blocks(s.blocks, blocks)
            if m > s.shared:
                s.shared = m
            longest = max(longest, m)
        return longest

    def choose(self, blocks: tuple[int, ...], now: float, shared: int = 0) -> SlotChoice:
        """Pin a request with ``blocks`` to a slot; ``shared``: its leading blocks known to
        serve other requests too."""
        pick, kept = self._pick(blocks)
        slot = self.slots[pick]
        old = slot.blocks
        slot.blocks = blocks
        slot.shared = max(kept, min(shared, len(blocks)))
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
    stored: set[int] = field(default_factory=set)  # see InstanceSlots.stored
    # Instances that keep a host prompt cache (gateway/host_cache_probes.py): never pinned.
    host_cached: set[str] = field(default_factory=set)
    _held: dict[str, tuple[str, int]] = field(default_factory=dict)  # request -> (instance, slot)

    def set_slots(self, instance_id: str, slots: int) -> None:
        """The engine reports ``slots`` parallel slots (``-np``); a new count starts afresh."""
        cur = self.instances.get(instance_id)
        if slots <= 0 or instance_id in self.host_cached:
            return
        if cur is not None and len(cur.slots) == slots:
            return
        self.instances[instance_id] = InstanceSlots(
            [SlotState() for _ in range(slots)],
            self.min_match_blocks,
            self.max_waiting,
            self.stored,
        )

    def forget(self, instance_id: str) -> None:
        self.instances.pop(instance_id, None)

    def assign(
        self, request_id: str, instance_id: str, blocks: Sequence[int], now: float
    ) -> SlotChoice | None:
        """The slot for a request placed on ``instance_id``; None when it is not a llama.cpp
        instance with known slots (the engine picks)."""
        inst = self.instances.get(instance_id)
        if inst is None or request_id in self._held:
            return None
        blocks = tuple(blocks)
        # Whatever prefix of it any slot of the fleet holds now serves two requests.
        shared = max(i.note_shared(blocks) for i in self.instances.values())
        choice = inst.choose(blocks, now, shared)
        self._held[request_id] = (instance_id, choice.slot)
        return choice

    def shared_evictions(self, instance_id: str, blocks: Sequence[int]) -> int:
        """The shared prefix blocks placing ``blocks`` on ``instance_id`` would overwrite
        (``InstanceSlots.shared_evictions``); 0 where kvgate knows no slots."""
        inst = self.instances.get(instance_id)
        return inst.shared_evictions(tuple(blocks)) if inst is not None else 0

    def release(self, request_id: str, now: float) -> tuple[str, int, SlotState] | None:
        """The request finished: its slot frees. Returns the instance, slot and the slot's
        state after the release (None when the request held no slot)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return None
        instance_id, slot = held
        inst = self.instances.get(instance_id)
        if inst is None or slot >= len(inst.slots):
            return None
        inst.release(slot, now)
        return instance_id, slot, inst.slots[slot]

    @property
    def held(self) -> int:
        return len(self._held)
