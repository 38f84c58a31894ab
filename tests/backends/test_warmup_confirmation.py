"""The warm-up sink with the Conductor's books: a copy is confirmed by KV events reaching the
index (not by predicted blocks), the spare-capacity gate reads the predicted queue and health,
and per-pool sinks (config and dispatch)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from backends.replication import DryRunSink, Outcome, SinkByDestination
from backends.warmup_sink import (
    ConductorCluster,
    has_spare_capacity,
    prompt_tokens_processed,
    storable_blocks,
)
from config.errors import ConfigError
from config.loader import load_settings
from config.settings import InstanceSettings, PoolSettings, ReplicationSink, Role, Settings
from routing.conductor import Conductor
from routing.types import BlockStored
from tests.backends.test_warmup_sink import (
    BS,
    HASHER,
    HASHES,
    FakeEngine,
    StubCluster,
    _cmd,
    _sink,
    _with_engine,
)


def _conductor(ttl_s: float | None = 60.0) -> Conductor:
    insts = tuple(InstanceSettings(i, f"http://127.0.0.1:1/{i}", Role.BOTH) for i in "ab")
    base = Settings()
    settings = replace(
        base,
        routing=replace(base.routing, block_size=BS, predict_on_route_ttl_s=ttl_s),
        pools=(PoolSettings("main", Role.BOTH, insts),),
    )
    return Conductor(settings)


def test_with_kv_events_ok_waits_for_the_engine_to_confirm_the_blocks() -> None:
    conductor = _conductor()
    loop_calls: list[str] = []

    def engine_publishes(body: dict[str, Any]) -> None:
        # The engine's BlockStored arrives a little after its answer, as over ZMQ.
        def stored() -> None:
            loop_calls.append("stored")
            conductor.kv_event("b", BlockStored(HASHER.hash_tokens(body["prompt"])), 0.0)

        asyncio.get_running_loop().call_later(0.05, stored)

    engine = FakeEngine(on_request=engine_publishes)

    async def run(url, session):
        cluster = ConductorCluster(
            conductor, lambda: 0.0, {"b": url}.get, lambda iid: True, max_queue_s=1.0
        )
        return await _sink(session, cluster).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.ok and loop_calls == ["stored"]
    assert all(conductor.index.holds("b", h) for h in HASHES)


def test_predicted_blocks_do_not_confirm_a_copy() -> None:
    conductor = _conductor(ttl_s=60.0)
    # The gateway routed the prompt to b (a prediction); the engine never said it stored it.
    conductor.index.record_route("b", HASHES, 0.0)
    engine = FakeEngine()

    async def run(url, session):
        cluster = ConductorCluster(
            conductor, lambda: 0.0, {"b": url}.get, lambda iid: True, max_queue_s=1.0
        )
        return await _sink(session, cluster, timeout_s=0.2).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.TIMEOUT and len(engine.bodies) == 1
    assert "KV events" in (res.error or "")


def test_blocks_inside_a_partial_engine_block_are_not_awaited() -> None:
    # Engine blocks of 32 tokens, kvgate's of 16: a 5-block (80-token) prefix is cached by
    # the engine as 2 blocks (64 tokens), so kvgate's 5th block never shows up in its events.
    engine = FakeEngine()
    cmd = _cmd(HASHES[2:5])  # the prefix's blocks 3-5 of 5

    async def run(url, session):
        cluster = StubCluster(
            {"b": url}, kv_events=True, engine_block=32, confirmed_blocks=set(HASHES[:4])
        )
        return await _sink(session, cluster, timeout_s=2.0).execute(cmd)

    assert asyncio.run(_with_engine(engine, run)).ok
    assert storable_blocks(cmd, 5 * BS, 32) == HASHES[2:4]
    assert storable_blocks(cmd, 5 * BS, None) == HASHES[2:5]
    assert storable_blocks(cmd, 5 * BS, 16) == HASHES[2:5]
    assert storable_blocks(_cmd(HASHES[:1]), BS, 32) == ()  # less than one engine block
    assert storable_blocks(_cmd(HASHES[:5]), 5 * BS, 64) == HASHES[:4]  # 64-token engine blocks


def test_the_spare_capacity_gate_reads_the_predicted_queue_and_health() -> None:
    conductor = _conductor()
    b = conductor.instances["b"]
    assert has_spare_capacity(b, 0.0, 1024, max_queue_s=0.5)
    b.enqueue_prefill("r1", duration_s=2.0, prompt_tokens=4000, now=0.0, ready_s=0.0)
    assert not has_spare_capacity(b, 0.0, 1024, max_queue_s=0.5)
    assert has_spare_capacity(b, 1.8, 1024, max_queue_s=0.5)  # its queue drains by then
    b.finish_prefill("r1", 0.1)
    assert not has_spare_capacity(b, 0.1, b.capacity_tokens + 1, max_queue_s=0.5)
    b.healthy = False
    assert not has_spare_capacity(b, 0.1, 1024, max_queue_s=0.5)
    cluster = ConductorCluster(
        conductor, lambda: 0.1, lambda iid: None, lambda iid: False, max_queue_s=0.5
    )
    assert cluster.spare("a", 1024) and not cluster.spare("b", 1024)
    assert not cluster.spare("gone", 1024)


def test_prompt_tokens_processed_reads_usage_or_llamacpp_timings() -> None:
    assert prompt_tokens_processed({"usage": {"prompt_tokens": 640}}) == 640
    assert prompt_tokens_processed({"timings": {"prompt_n": 4, "cache_n": 636}}) == 640
    assert prompt_tokens_processed({"choices": []}) is None
    assert prompt_tokens_processed(["not", "a", "dict"]) is None


def test_per_pool_sinks_run_each_command_on_its_destinations_sink() -> None:
    engine = FakeEngine()

    async def run(url, session):
        dry = DryRunSink()
        warm = _sink(session, StubCluster({"b": url}))
        by_dest = SinkByDestination(
            {"warmup": warm, "dry_run": dry}, {"b": "warmup", "a": "dry_run"}.get
        )
        to_b = await by_dest.execute(_cmd())
        to_a = await by_dest.execute(replace(_cmd(), destination="a"))
        return to_b, to_a, dry.commands

    to_b, to_a, recorded = asyncio.run(_with_engine(engine, run))
    assert to_b.ok and len(engine.bodies) == 1
    assert to_a.outcome is Outcome.NOT_EXECUTED and [c.destination for c in recorded] == ["a"]


def _config(tmp_path, pools: str, replication: str = "") -> Settings:
    path = tmp_path / "kvgate.toml"
    path.write_text(f"[replication]\n{replication}\n{pools}")
    return load_settings(path)


POOLS = """
[[pools]]
name = "llama"
role = "both"
replication_sink = "warmup"
instances = [{{ id = "l0", url = "http://127.0.0.1:18701" }}]

[[pools]]
name = "emu"
role = "{role}"
instances = [{{ id = "e0", url = "http://127.0.0.1:18702" }}]
"""


def test_a_pool_chooses_its_sink_and_others_keep_the_default(tmp_path) -> None:
    from gateway.runtime import Gateway

    s = _config(tmp_path, POOLS.format(role="both"), 'sink = "engine"\nwarmup_max_queue_s = 0.2')
    assert s.pools[0].replication_sink is ReplicationSink.WARMUP
    assert s.pools[1].replication_sink is None
    assert s.replication.warmup_max_queue_s == 0.2
    gw = Gateway(s)
    assert gw.replicator.sink_kind("l0") is ReplicationSink.WARMUP
    assert gw.replicator.sink_kind("e0") is ReplicationSink.ENGINE
    # a warm-up pool: the gateway keeps prompt tokens
    assert gw.replicator.prefix_tokens is not None
    assert Gateway(replace(s, pools=s.pools[1:])).replicator.prefix_tokens is None


def test_a_decode_pool_cannot_name_a_sink(tmp_path) -> None:
    pools = POOLS.replace('role = "both"\nreplication_sink', 'role = "decode"\nreplication_sink')
    with pytest.raises(ConfigError, match=r"pools\[0\]\.replication_sink"):
        _config(tmp_path, pools.format(role="prefill"))


def test_warmup_settings_are_validated(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"replication\.warmup_max_queue_s"):
        _config(tmp_path, "", "warmup_max_queue_s = 0")
