"""The engines' KV events, per instance, into the Conductor's cache view.

One subscriber per instance that publishes events (vLLM's ZMQ publisher; the emulator's),
and one engine-hash -> own-key map per instance (backends/engine_keys.py): events carry the
engine's hashes and token ids, the KV index is keyed by kvgate's own block keys in the
instance's model's key space. Lost events (a gap the replay endpoint cannot fill) clear what
kvgate believes the instance holds; it re-learns from the next events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import urlsplit

from backends.engine_events import EngineEvent
from backends.engine_keys import EngineKeyMap
from backends.kv_events import KVEventSubscriber
from config.settings import InstanceSettings
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.types import AllBlocksCleared


class KvEventFeeds:
    def __init__(
        self,
        conductor: Conductor,
        clock: Callable[[], float],
        hasher_of: Callable[[str], BlockHasher],  # instance id -> its model's key space
    ) -> None:
        self._conductor = conductor
        self._clock = clock
        self._hasher_of = hasher_of
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.keys: dict[str, EngineKeyMap] = {}  # per instance: engine hash -> own keys

    def sends_events(self, instance_id: str) -> bool:
        return instance_id in self.subscribers

    def subscribe(self, spec: InstanceSettings, stop: asyncio.Event) -> asyncio.Task[None]:
        """Start listening to ``spec``'s publisher; the task ends when ``stop`` is set."""
        assert spec.kv_events_endpoint is not None
        self.keys[spec.id] = EngineKeyMap(self._hasher_of(spec.id))
        sub = KVEventSubscriber(
            spec.kv_events_endpoint,
            spec.id,
            self._on_events,
            engine_host=urlsplit(spec.url).hostname or "127.0.0.1",
            bind=spec.kv_events_bind,
            replay_endpoint=spec.kv_events_replay_endpoint,
            on_resync=self._on_resync,
        )
        self.subscribers[spec.id] = sub
        return asyncio.create_task(sub.run(stop))

    def remove(self, instance_id: str) -> None:
        sub = self.subscribers.pop(instance_id, None)
        if sub is not None:
            sub.close()
        self.keys.pop(instance_id, None)

    def close(self) -> None:
        for sub in self.subscribers.values():
            sub.close()

    def _on_events(self, instance_id: str, events: list[EngineEvent]) -> None:
        keys = self.keys.get(instance_id)
        if keys is None:  # removed while a batch was in flight
            return
        now = self._clock()
        for ev in keys.apply(events):  # the engine's hashes -> kvgate's own keys
            self._conductor.kv_event(instance_id, ev, now)

    def _on_resync(self, instance_id: str) -> None:
        keys = self.keys.get(instance_id)
        if keys is not None:
            keys.clear()
        self._conductor.kv_event(instance_id, AllBlocksCleared(), self._clock())
