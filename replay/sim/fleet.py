"""The simulated fleet: which instances exist and the engine model behind each.

``FleetSpec`` says how many prefill / decode / colocated instances of which profile; it turns
into the pools of a kvgate ``Settings`` (so the Conductor sees exactly what a gateway
configured with that fleet would see) and into one ``Engine`` per instance.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from config.settings import InstanceSettings, PoolSettings, Role, Settings
from predictors.profiles import get_profile
from replay.engine.engine import Engine
from replay.engine.prefix_cache import PrefixCache
from replay.engine.timing import StepTiming


@dataclass(frozen=True, slots=True)
class FleetSpec:
    prefill: int = 8
    decode: int = 8
    colocated: int = 0
    profile: str = "llama2-70b-a100-tp8"
    # Prefix-cache capacity per prefill instance in tokens (None = the profile's KV capacity;
    # Mooncake keeps a much larger DRAM pool, so traces may want more).
    cache_capacity_tokens: int | None = None
    # Chunked prefill budget in tokens (None = one prompt per step).
    chunk_tokens: int | None = None
    # Mooncake's baseline: a decode instance refuses a request that would break its TBT SLO.
    decode_local_check: bool = True
    max_batch: int | None = None  # None = the profile's

    def validate(self) -> None:
        if self.colocated < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("instance counts must be >= 0")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("a fleet is either colocated or prefill + decode, not both")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a disaggregated fleet needs >= 1 prefill and >= 1 decode instance")
        get_profile(self.profile)

    def instances(self) -> list[tuple[str, Role]]:
        if self.colocated:
            return [(f"c{i}", Role.BOTH) for i in range(self.colocated)]
        return [(f"p{i}", Role.PREFILL) for i in range(self.prefill)] + [
            (f"d{i}", Role.DECODE) for i in range(self.decode)
        ]


def fleet_settings(base: Settings, fleet: FleetSpec) -> Settings:
    """``base`` with its pools replaced by the simulated fleet."""
    fleet.validate()
    cache = fleet.cache_capacity_tokens
    by_role: dict[Role, list[InstanceSettings]] = {}
    for iid, role in fleet.instances():
        by_role.setdefault(role, []).append(
            InstanceSettings(
                id=iid,
                url=f"http://sim.invalid/{iid}",  # never contacted
                role=role,
                profile=fleet.profile,
                capacity_tokens=cache if role is not Role.DECODE else None,
                max_batch=fleet.max_batch or get_profile(fleet.profile).max_batch,
            )
        )
    pools = tuple(PoolSettings(role.value, role, tuple(insts)) for role, insts in by_role.items())
    return replace(base, pools=pools, predictors=replace(base.predictors, profile=fleet.profile))


def build_engines(settings: Settings, fleet: FleetSpec) -> dict[str, Engine]:
    profile = get_profile(fleet.profile)
    timing = StepTiming.from_profile(profile, settings.predictors.overhead_ms)
    block = settings.routing.block_size
    tbt_limit = settings.slo.tbt_s if fleet.decode_local_check else None
    engines = {}
    for spec in settings.instances():
        capacity = spec.capacity_tokens or profile.kv_capacity_tokens
        cache = None
        if spec.role is not Role.DECODE:
            cache = PrefixCache(max(capacity // block, 1))
        engines[spec.id] = Engine(
            spec.id,
            spec.role,
            timing,
            cache=cache,
            max_batch=spec.max_batch or profile.max_batch,
            kv_capacity_tokens=profile.kv_capacity_tokens,
            chunk_tokens=fleet.chunk_tokens
            if spec.role is not Role.BOTH
            else (fleet.chunk_tokens or profile.max_batched_tokens),
            decode_tbt_limit_s=tbt_limit if spec.role is not Role.PREFILL else None,
        )
    return engines
