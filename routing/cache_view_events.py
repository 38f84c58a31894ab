"""The Conductor's view of where KV blocks are: what the engines and the copies report.

``kv_event`` applies an engine's KV event (stored, removed, all cleared) to the index, and an
eviction also lengthens the queued prefills that counted on the blocks (``prefix_evicted``,
routing/request_progress.py); ``evict`` is the same for an eviction the gateway inferred (a
llama.cpp slot it reused); ``set_capacity`` takes the KV capacity an engine reports;
``replication_done`` / ``replication_dropped`` close a copy command. A mixin of the Conductor
(routing/conductor.py), which owns the state named below; time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable

from routing.hotspot import HotspotPlanner
from routing.instance_books import InstanceState
from routing.kv_index import KVIndex
from routing.llamacpp_slots import SlotBook
from routing.types import BlockRemoved, BlockStored, KVEvent, ReplicationCommand, Tier


class CacheViewEvents:
    """KV-view callbacks over the Conductor's state (declared here for the type checker)."""

    block_size: int
    instances: dict[str, InstanceState]
    index: KVIndex
    planner: HotspotPlanner
    slots: SlotBook
    _event_fed: set[str]
    prefix_evicted: Callable[[str, tuple[int, ...], float], None]  # RequestProgress's

    def set_capacity(self, instance_id: str, capacity_tokens: int) -> None:
        """The engine reported its KV capacity (tokens): it replaces the profile's."""
        inst = self.instances.get(instance_id)
        if inst is None or capacity_tokens <= 0 or inst.capacity_tokens == capacity_tokens:
            return
        inst.capacity_tokens = capacity_tokens
        if instance_id in self.index:
            self.index.set_capacity(instance_id, max(capacity_tokens // self.block_size, 1))

    def kv_event(self, instance_id: str, event: KVEvent, now: float) -> None:
        self._event_fed.add(instance_id)
        self.index.apply(instance_id, event, now)
        if isinstance(event, BlockRemoved):
            self.prefix_evicted(instance_id, event.block_hashes, now)

    def evict(self, instance_id: str, block_hashes: tuple[int, ...], now: float) -> None:
        """The gateway knows the engine dropped these blocks without an event saying so (a
        llama.cpp slot it reused for another prompt); the instance stays feedback-corrected."""
        self.index.apply(instance_id, BlockRemoved(block_hashes), now)
        self.prefix_evicted(instance_id, block_hashes, now)

    def store_changed(self, event: BlockStored | BlockRemoved) -> None:
        """The gateway wrote a file of the shared store tier (``BlockStored``: the prefix it
        holds) or deleted one (``BlockRemoved``: its blocks no other file holds); a llama.cpp
        slot file, gateway/slot_files.py."""
        self.index.apply_store(event)
        if isinstance(event, BlockStored):
            self.slots.stored.update(event.block_hashes)
        else:
            self.slots.stored.difference_update(event.block_hashes)

    def replication_dropped(self, command_id: str) -> None:
        """A command that will not be executed (dry run): release its in-flight slot."""
        self.planner.drop(command_id)

    def replication_done(
        self, command_id: str, ok: bool, now: float, tier: Tier = Tier.GPU
    ) -> ReplicationCommand | None:
        """A copy finished. On success the destination holds the blocks (on ``tier``; a copy
        into the shared store makes them loadable by every instance); on failure the index
        is unchanged and a retry command may be returned."""
        entry = self.planner.in_flight.get(command_id)
        if entry is not None and ok:
            cmd = entry.command
            if tier is Tier.STORE:
                self.index.apply_store(BlockStored(cmd.block_hashes, Tier.STORE))
            elif cmd.destination in self.instances:
                self.index.apply(cmd.destination, BlockStored(cmd.block_hashes, tier), now)
        return self.planner.complete(command_id, ok, now)
