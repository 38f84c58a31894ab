"""The pools a request may be placed on: the eligible instances, per served model.

Rebuilt by the Conductor whenever the fleet changes (an instance added, removed, drained,
unhealthy or back), so that a decision reads two lists instead of filtering the fleet.
Instances are kept in registration order (``bit_order``): policies break ties by it. A
``rotation`` k starts every list at its k-th instance instead (wrapping around), so gateway
replicas that decide at the same instant break their ties on different instances.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from config.settings import Role
from routing.instance_books import InstanceState


@dataclass(slots=True)
class ModelPools:
    """Eligible prefill-capable and decode instances; ``has_decode_pool`` also counts the
    decode instances that are not eligible now (their absence is then a 503, not colocation)."""

    prefill: list[InstanceState] = field(default_factory=list)
    decode: list[InstanceState] = field(default_factory=list)
    has_decode_pool: bool = False


def rotated(items: list[InstanceState], k: int) -> list[InstanceState]:
    if not items or not k:
        return items
    k %= len(items)
    return items[k:] + items[:k]


class FleetPools:
    __slots__ = ("_by_model", "fleet", "rotation")

    def __init__(self) -> None:
        self.fleet = ModelPools()  # every model's instances together
        self._by_model: dict[str | None, ModelPools] = {}
        self.rotation = 0  # ties start at this position of each list (Conductor.rotate_ties)

    def refresh(self, instances: Iterable[InstanceState]) -> None:
        ordered = sorted(instances, key=lambda i: i.bit_order)
        fleet = ModelPools(
            [i for i in ordered if i.eligible and i.does_prefill],
            [i for i in ordered if i.eligible and i.role is Role.DECODE],
            any(i.role is Role.DECODE for i in ordered),
        )
        # Per served model: a request is only ever placed on its own model's instances.
        by_model: dict[str | None, ModelPools] = {}
        for inst in ordered:
            pools = by_model.setdefault(inst.model, ModelPools())
            pools.has_decode_pool |= inst.role is Role.DECODE
            if inst.eligible and inst.does_prefill:
                pools.prefill.append(inst)
            elif inst.eligible and inst.role is Role.DECODE:
                pools.decode.append(inst)
        if self.rotation:
            for pools in (fleet, *by_model.values()):
                pools.prefill = rotated(pools.prefill, self.rotation)
                pools.decode = rotated(pools.decode, self.rotation)
        self.fleet, self._by_model = fleet, by_model

    def for_model(self, model: str | None) -> ModelPools:
        """``model`` None: the whole fleet (no ``models`` configured, or none named)."""
        if model is None:
            return self.fleet
        return self._by_model.get(model) or ModelPools()


def least_loaded(instances: Iterable[InstanceState], now: float) -> InstanceState | None:
    """The instance whose queue empties first (ties: the fleet's order); None if there is none.
    For requests that need no placement (the picker's passthrough, the engines' tokenizers)."""
    return min(instances, key=lambda i: (i.queue_time(now), i.bit_order), default=None)
