"""The warm-up sink against a fake engine (an aiohttp server on 127.0.0.1): the request it
sends, bounded retries, its timeout, waiting for spare capacity, and confirmation by the
answer's usage. With the Conductor's books and per-pool sinks: test_warmup_confirmation.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.prefix_tokens import PrefixTokenStore
from backends.replication import Outcome
from backends.warmup_sink import (
    WarmupSink,
    warmup_body,
)
from routing.hashing import BlockHasher
from routing.tokenizer import pack_token_ids
from routing.types import ReplicationCommand, ReplicationReason

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


def test_through_a_connector_store_the_source_writes_the_prefix_first() -> None:
    """``publish_on_source``: the source (a cache hit there) runs the same warm-up first, so
    that its KV connector writes the prefix to the shared store; then the destination's."""
    engine = FakeEngine()

    async def run(url, session):
        cluster = StubCluster({"a": url, "b": url})
        return await _sink(session, cluster, publish_on_source=True).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.OK and res.attempts == 1
    assert engine.request_ids == ["kvgate-publish-rep-1", "kvgate-warmup-rep-1"]
    assert engine.bodies[0] == engine.bodies[1] == warmup_body(_store().lookup(HASHES[-1]))


@pytest.mark.parametrize("source_known", [True, False])
def test_a_source_that_cannot_write_to_the_store_leaves_the_destination_to_compute(
    source_known: bool, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine(replies=[(500, {"error": "boom"}, 0.0)] if source_known else [])

    async def run(url, session):
        urls = {"a": url, "b": url} if source_known else {"b": url}
        return await _sink(session, StubCluster(urls), publish_on_source=True).execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.OK  # the destination computed it
    expected = ["kvgate-publish-rep-1"] if source_known else []
    assert engine.request_ids == [*expected, "kvgate-warmup-rep-1"]  # the publish: one try
    assert "the source did not write the prefix to the store" in caplog.text


def test_a_busy_source_gets_half_the_copys_time_then_the_destination_goes_on(caplog) -> None:
    engine = FakeEngine(replies=[(200, usage(len(PROMPT)), 2.0)])  # the source: 2 s to answer

    async def run(url, session):
        sink = _sink(session, StubCluster({"a": url, "b": url}), publish_on_source=True)
        sink.timeout_s = 1.0
        return await sink.execute(_cmd())

    res = asyncio.run(_with_engine(engine, run))
    assert res.outcome is Outcome.OK and res.latency_s < 1.0  # ~0.5 s on the source, then b
    assert engine.request_ids[-1] == "kvgate-warmup-rep-1"
    assert "no answer from the source within 0.5 s" in caplog.text
