"""Builders for scheduling-core tests: real settings, real predictors, real Conductor."""

from __future__ import annotations

from dataclasses import replace

from config.settings import (
    AdmissionMode,
    AdmissionSettings,
    InstanceSettings,
    PoolSettings,
    ReplicationSettings,
    Role,
    RoutingSettings,
    Settings,
    SLOSettings,
)
from routing.conductor import Conductor
from routing.types import BlockStored, RequestInfo

BLOCK = 16


def fleet_settings(
    prefill: int = 3,
    decode: int = 2,
    *,
    policy: str = "kvcache_centric",
    admission: AdmissionMode = AdmissionMode.NONE,
    colocated: int = 0,
    **sections: object,
) -> Settings:
    pools = []
    if prefill:
        pools.append(
            PoolSettings(
                "prefill",
                Role.PREFILL,
                tuple(
                    InstanceSettings(f"p{i}", f"http://127.0.0.1:{9100 + i}", Role.PREFILL)
                    for i in range(prefill)
                ),
            )
        )
    if decode:
        pools.append(
            PoolSettings(
                "decode",
                Role.DECODE,
                tuple(
                    InstanceSettings(f"d{i}", f"http://127.0.0.1:{9200 + i}", Role.DECODE)
                    for i in range(decode)
                ),
            )
        )
    if colocated:
        pools.append(
            PoolSettings(
                "both",
                Role.BOTH,
                tuple(
                    InstanceSettings(f"c{i}", f"http://127.0.0.1:{9300 + i}", Role.BOTH)
                    for i in range(colocated)
                ),
            )
        )
    settings = Settings(
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
        routing=RoutingSettings(
            policy=policy, block_size=BLOCK, min_transfer_blocks=4, kvcache_balancing_threshold=1.5
        ),
        admission=AdmissionSettings(mode=admission),
        replication=ReplicationSettings(),
        pools=tuple(pools),
    )
    return replace(settings, **sections) if sections else settings


def request(
    rid: str,
    blocks: tuple[int, ...],
    *,
    now: float = 0.0,
    max_tokens: int = 128,
    **kw: object,
) -> RequestInfo:
    return RequestInfo(
        request_id=rid,
        prompt_tokens=len(blocks) * BLOCK,
        block_hashes=blocks,
        max_tokens=max_tokens,
        arrival_s=now,
        **kw,  # type: ignore[arg-type]
    )


def prompt(family: int, n: int, start: int = 0) -> tuple[int, ...]:
    """Block hashes of a prompt family: prompts of one family share their leading blocks."""
    return tuple(family * 1_000_000 + i for i in range(start, start + n))


def hold(conductor: Conductor, instance: str, blocks: tuple[int, ...]) -> None:
    conductor.kv_event(instance, BlockStored(blocks), 0.0)


def busy(conductor: Conductor, instance: str, seconds: float, now: float = 0.0) -> None:
    """Queue `seconds` of prefill work on an instance (as if other requests were dispatched)."""
    conductor.instances[instance].enqueue_prefill(
        f"filler-{instance}-{seconds}", seconds, 1024, now, now
    )


def make_conductor(**kw: object) -> Conductor:
    return Conductor(fleet_settings(**kw))  # type: ignore[arg-type]


def full_decode_conductor(admission: AdmissionMode = AdmissionMode.EARLY) -> Conductor:
    """One prefill and one decode instance whose batch today (100 sequences of 3,000 tokens,
    ``run0``..``run99``) fails a 20 ms TBT SLO: every request is turned away on its TBT."""
    from routing.instance_books import DecodeWork

    c = make_conductor(prefill=1, decode=1, admission=admission, slo=SLOSettings(tbt_s=0.02))
    d0 = c.instances["d0"]
    for i in range(100):
        d0.add_incoming(DecodeWork(f"run{i}", 3000, 10, 0.0))
        d0.start_decode(f"run{i}", 0.0)
    return c
