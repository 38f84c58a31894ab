"""The Conductor's fleet: instances added, drained, marked healthy or not, and removed.

Each change refreshes the eligible pools (routing/fleet_pools.py) and tells the placement
policy which colocated instances it now places on; a removed instance's requests fail and its
blocks leave the KV index. A mixin of the Conductor (routing/conductor.py), which owns the
state named below; time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from config.settings import InstanceSettings, PDProtocol, Role, Settings
from predictors.bundle import InstancePredictors
from routing.fleet_pools import FleetPools
from routing.hotspot import HotspotPlanner
from routing.instance_books import InstanceState
from routing.kv_index import KVIndex
from routing.llamacpp_slots import SlotBook
from routing.policies.base import Policy

_BIT_ORDER = attrgetter("bit_order")


class FleetMembership:
    """Fleet changes over the Conductor's state (declared here for the type checker)."""

    settings: Settings
    block_size: int
    instances: dict[str, InstanceState]
    index: KVIndex
    pools: FleetPools
    planner: HotspotPlanner
    slots: SlotBook
    policy: Policy
    requests: dict
    _event_fed: set[str]
    _order: int
    _last_now: float
    _predictors_for: Callable[[str | None], InstancePredictors]
    _drop: Callable[[str, float], object]  # RequestProgress's

    def add_instance(self, spec: InstanceSettings) -> InstanceState:
        if spec.id in self.instances:
            raise ValueError(f"instance {spec.id!r} already exists")
        model = self.settings.served_model(spec.model) if spec.model else None
        preds = self._predictors_for(spec.profile or (model.profile if model else None))
        capacity = spec.capacity_tokens or preds.profile.kv_capacity_tokens
        inst = InstanceState(
            id=spec.id,
            role=spec.role,
            predictors=preds,
            capacity_tokens=capacity,
            max_batch=spec.max_batch or preds.profile.max_batch,
            bit_order=self._order,
            model=spec.model,
            decode_after_prefill=spec.protocol is not PDProtocol.SGLANG,
        )
        self._order += 1
        self.instances[spec.id] = inst
        if inst.does_prefill:
            self.index.add_instance(
                spec.id,
                max(capacity // self.block_size, 1),
                spec.host_capacity_tokens // self.block_size,
            )
        self._refresh_pools()
        return inst

    def drain_instance(self, instance_id: str, draining: bool = True) -> None:
        self.instances[instance_id].draining = draining
        self._refresh_pools()

    def set_max_batch(self, instance_id: str, max_batch: int) -> None:
        """The engine said how many sequences it runs at once (llama.cpp's slots)."""
        inst = self.instances.get(instance_id)
        if inst is not None and max_batch > 0:
            inst.max_batch = max_batch

    def set_queue_scale(self, instance_id: str, scale: float) -> None:
        """What the answers say the booked queue waits really take, as a factor."""
        inst = self.instances.get(instance_id)
        if inst is not None and scale > 0:
            inst.queue_scale = scale

    def set_health(self, instance_id: str, healthy: bool) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None and inst.healthy != healthy:
            inst.healthy = healthy
            self._refresh_pools()

    def remove_instance(self, instance_id: str, now: float) -> list[str]:
        """Forget an instance; returns the ids of requests that were on it (now failed)."""
        inst = self.instances.pop(instance_id)
        affected = [r for r in inst.clear_work() if r in self.requests]  # not peer replicas'
        for rid in affected:
            self._drop(rid, now)
        if inst.does_prefill:
            self.index.remove_instance(instance_id)
        self._event_fed.discard(instance_id)
        self.planner.forget_instance(instance_id)
        self.slots.forget(instance_id)
        self._refresh_pools(now)
        return affected

    def _refresh_pools(self, now: float | None = None) -> None:
        if now is not None:
            self._last_now = max(self._last_now, now)
        self.pools.refresh(self.instances.values())
        # Registration order for the policy's own grouping, whatever the pools' tie rotation.
        both = sorted((i for i in self.pools.fleet.prefill if i.role is Role.BOTH), key=_BIT_ORDER)
        self.policy.on_fleet_change(both, self._last_now)

    def rotate_ties(self, rotation: int) -> None:
        """Break placement ties starting at the ``rotation``-th eligible instance of each
        pool instead of the first (a gateway replica's rank: routing/fleet_pools.py)."""
        self.pools.rotation = max(0, rotation)
        self._refresh_pools()
