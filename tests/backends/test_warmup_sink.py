"""The warm-up sink against a fake engine (an aiohttp server on 127.0.0.1): the request it
sends, bounded retries, its timeout, the spare-capacity gate, and confirmation by the engine's
own signal (KV events reaching the Conductor's index, or the answer's usage)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.prefix_tokens import PrefixTokenStore
from backends.replication import DryRunSink, Outcome, SinkByDestination
from backends.warmup_sink import (
    ConductorCluster,
    WarmupSink,
    has_spare_capacity,
    prompt_tokens_processed,
    storable_blocks,
    warmup_body,
)
from config.errors import ConfigError
from config.loader import load_settings
from config.settings import InstanceSettings, PoolSettings, ReplicationSink, Role, Settings
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.tokenizer import pack_token_ids
from routing.types import BlockStored, ReplicationCommand, ReplicationReason

BS = 16
HASHER = BlockHasher(BS)
PROMPT = list(range(1000, 1000 + 6 * BS))  # 6 full blocks
HASHES = HASHER.hash_tokens(PROMPT)


@dataclass
class FakeEngine:
    """Answers /v1/completions as an engine would; ``replies`` scripts (status, body, delay)."""

    replies: list[tuple[int, dict[str, Any], float]] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str | None] = field(default_factory=list)
    on_request: Callable[[dict[str, Any]], None] | None = None

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id"))
        status, payload, delay = (
            self.replies.pop(0) if self.replies else (200, usage(len(body["prompt"])), 0.0)
        )
        if delay:
            await asyncio.sleep(delay)
        if self.on_request is not None:
            self.on_request(body)
        return web.json_response(payload, status=status)


def usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "choices": [{"text": "x", "index": 0, "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1},
    }


@dataclass
class StubCluster:
    urls: dict[str, str]
    spare_after: int = 0  # the gate opens after this many checks (-1: never)
    kv_events: bool = False
    confirmed_blocks: set[int] = field(default_factory=set)
    engine_block: int | None = None
    spare_checks: int = 0

    def url(self, instance_id: str) -> str | None:
        return self.urls.get(instance_id)

    def spare(self, instance_id: str, tokens: int) -> bool:
        self.spare_checks += 1
        return self.spare_after >= 0 and self.spare_checks > self.spare_after

    def reports_kv_events(self, instance_id: str) -> bool:
        return self.kv_events

    def confirmed(self, instance_id: str, block_hashes: Sequence[int]) -> bool:
        return all(h in self.confirmed_blocks for h in block_hashes)

    def engine_block_tokens(self, instance_id: str) -> int | None:
        return self.engine_block


def _store() -> PrefixTokenStore:
    store = PrefixTokenStore(BS)
    store.remember(HASHES, pack_token_ids(PROMPT), model="tiny", cache_salt="salt-1")
    return store


def _cmd(blocks: Sequence[int] = HASHES[2:], request_id: str | None = None) -> ReplicationCommand:
    return ReplicationCommand(
        command_id="rep-1",
        source="a",
        destination="b",
        block_hashes=tuple(blocks),
        tokens=len(blocks) * BS,
        reason=ReplicationReason.PROACTIVE if request_id is None else ReplicationReason.REACTIVE,
        prefix_key=blocks[-1],
        issued_s=0.0,
        request_id=request_id,
    )


async def _with_engine(
    engine: FakeEngine, run: Callable[[str, aiohttp.ClientSession], Awaitable[Any]]
) -> Any:
    app = web.Application()
    app.router.add_post("/v1/completions", engine.completions)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            return await run(str(server.make_url("")).rstrip("/"), session)
    finally:
        await server.close()


def _sink(session, cluster, store=None, **kw) -> WarmupSink:
    kw.setdefault("poll_s", 0.005)
    kw.setdefault("timeout_s", 5.0)
    return WarmupSink(session, cluster, store or _store(), kv_bytes_per_token={"b": 100}, **kw)


def test_sends_the_prefix_token_ids_as_a_one_token_completion() -> None:
    engine = FakeEngine()

    async def run(url, session):
        cluster = StubCluster({"b": url})
        return await _sink(session, cluster).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.OK and res.attempts == 1 and res.error is None
    assert res.bytes == 4 * BS * 100  # the 4 blocks copied, at 100 bytes per token
    [body] = engine.bodies
    # The whole prefix up to the command's last block, not just the blocks it copies.
    assert body == {
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
        "model": "tiny",
        "cache_salt": "salt-1",
    }
    assert engine.request_ids == ["kvgate-warmup-rep-1"]


def test_a_llamacpp_destination_gets_the_slot_the_gateway_pins_and_releases_it() -> None:
    engine = FakeEngine()
    pins: list[tuple[str, str, tuple[int, ...]]] = []
    unpins: list[str] = []

    def pin(rid: str, instance: str, blocks) -> int:
        pins.append((rid, instance, tuple(blocks)))
        return 1

    async def run(url, session):
        sink = _sink(session, StubCluster({"b": url}), pin=pin, unpin=unpins.append)
        return await sink.execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.OK
    [body] = engine.bodies
    assert body["id_slot"] == 1
    # The slot learns the whole prefix chain from its first block, not only the copied blocks.
    assert pins == [("kvgate-warmup-rep-1", "b", tuple(HASHES))]
    assert unpins == ["kvgate-warmup-rep-1"]


def test_a_shorter_prefix_sends_only_its_own_tokens() -> None:
    engine = FakeEngine()

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url})).execute(_cmd(HASHES[1:3]))

    assert asyncio.run(_with_engine(engine, run)).ok
    assert engine.bodies[0]["prompt"] == PROMPT[: 3 * BS]


def test_without_model_or_salt_the_body_leaves_them_out() -> None:
    store = PrefixTokenStore(BS)
    store.remember(HASHES, pack_token_ids(PROMPT))
    found = store.lookup(HASHES[-1])
    assert found is not None
    assert set(warmup_body(found)) == {"prompt", "max_tokens", "temperature", "stream"}


@pytest.mark.parametrize(
    ("cmd", "urls", "error"),
    [
        (_cmd(request_id="req-1"), {"b": "URL"}, "reactive"),
        (_cmd(), {}, "unknown destination"),
        (_cmd([*HASHES[:2], 777]), {"b": "URL"}, "not known"),
    ],
)
def test_commands_it_cannot_or_should_not_run_are_not_executed(cmd, urls, error) -> None:
    engine = FakeEngine()

    async def run(url, session):
        cluster = StubCluster({k: url for k in urls})
        return await _sink(session, cluster).execute(cmd)

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.NOT_EXECUTED and error in (res.error or "")
    assert engine.bodies == []  # nothing reached the engine


def test_waits_for_spare_capacity_before_sending() -> None:
    engine = FakeEngine()

    async def run(url, session):
        cluster = StubCluster({"b": url}, spare_after=3)
        res = await _sink(session, cluster).execute(_cmd())
        return res, cluster.spare_checks

    res, checks = asyncio.run(_with_engine(engine, run))
    assert res.ok and checks == 4 and len(engine.bodies) == 1


def test_a_destination_that_stays_busy_gets_nothing() -> None:
    engine = FakeEngine()

    async def run(url, session):
        cluster = StubCluster({"b": url}, spare_after=-1)
        return await _sink(session, cluster, timeout_s=0.05).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.NOT_EXECUTED and "busy" in (res.error or "")
    assert engine.bodies == []


def test_engine_errors_are_retried_a_bounded_number_of_times() -> None:
    engine = FakeEngine(replies=[(503, {"error": "busy"}, 0.0)] * 10)

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url}), max_retries=2).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.FAILED and res.attempts == 3 and "HTTP 503" in res.error
    assert len(engine.bodies) == 3


def test_a_retry_that_succeeds_is_ok() -> None:
    engine = FakeEngine(replies=[(500, {"error": "x"}, 0.0)])

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url})).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.ok and res.attempts == 2


def test_a_refused_request_is_not_retried() -> None:
    err = {"error": {"code": 400, "message": "Prompt contains invalid tokens"}}
    engine = FakeEngine(replies=[(400, err, 0.0)] * 3)

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url})).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.FAILED and res.attempts == 1 and "invalid tokens" in res.error


def test_an_unreachable_engine_fails_after_the_retries() -> None:
    async def run():
        server = TestServer(web.Application(), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        await server.close()  # nothing listens there now
        async with aiohttp.ClientSession() as session:
            return await _sink(session, StubCluster({"b": url}), max_retries=1).execute(_cmd())

    res = asyncio.run(run())
    assert res.outcome is Outcome.FAILED and res.attempts == 2
    assert "ClientConnectorError" in (res.error or "")


def test_an_answer_that_did_not_process_the_prefix_is_a_failure() -> None:
    engine = FakeEngine(replies=[(200, usage(10), 0.0)])

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url})).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.FAILED and "processed 10" in (res.error or "")


def test_a_slow_engine_times_out() -> None:
    engine = FakeEngine(replies=[(200, usage(len(PROMPT)), 2.0)])

    async def run(url, session):
        return await _sink(session, StubCluster({"b": url}), timeout_s=0.1).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.TIMEOUT and res.attempts == 1


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
