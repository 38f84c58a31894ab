"""The replicator: sink per destination pool, a typed log, outcomes reported to the Conductor."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp

from backends.replication import DryRunSink, Outcome, ReplicationResult
from config.settings import (
    InstanceSettings,
    PoolSettings,
    ReplicationSettings,
    ReplicationSink,
    Role,
    Settings,
)
from gateway.metrics import GatewayMetrics
from gateway.replicator import EngineView, Replicator
from routing.conductor import Conductor
from routing.types import ReplicationCommand, ReplicationReason


def _settings(default: ReplicationSink, pool_sink: ReplicationSink | None) -> Settings:
    a = PoolSettings("a", Role.BOTH, (InstanceSettings("a0", "http://127.0.0.1:1", Role.BOTH),))
    b = PoolSettings(
        "b",
        Role.BOTH,
        (InstanceSettings("b0", "http://127.0.0.1:2", Role.BOTH),),
        replication_sink=pool_sink,
    )
    base = Settings()
    return replace(base, pools=(a, b), replication=ReplicationSettings(sink=default))


def _replicator(settings: Settings) -> tuple[Replicator, Conductor]:
    conductor = Conductor(settings)
    view = EngineView(
        urls={},
        sends_kv_events=lambda iid: False,
        engine_block_tokens=lambda iid: None,
        pin=lambda rid, iid, blocks: None,
        unpin=lambda rid: None,
    )
    return Replicator(lambda: settings, conductor, GatewayMetrics(), lambda: 1.0, view), conductor


def _cmd(dest: str, cid: str = "c1") -> ReplicationCommand:
    return ReplicationCommand(cid, "a0", dest, (1, 2), 32, ReplicationReason.PROACTIVE, 2, 0.0)


def test_sink_kind_is_the_destination_pools_else_the_default() -> None:
    rep, _ = _replicator(_settings(ReplicationSink.DRY_RUN, ReplicationSink.WARMUP))
    assert rep.sink_kind("a0") is ReplicationSink.DRY_RUN
    assert rep.sink_kind("b0") is ReplicationSink.WARMUP
    assert rep.sink_kinds() == {ReplicationSink.DRY_RUN, ReplicationSink.WARMUP}
    assert rep.prefix_tokens is not None  # a warm-up pool needs the prompts' token ids


def test_a_connector_store_pool_gets_a_warmup_sink_that_publishes_on_the_source() -> None:
    from backends.warmup_sink import WarmupSink

    rep, _ = _replicator(_settings(ReplicationSink.CONNECTOR_STORE, None))
    assert rep.prefix_tokens is not None  # it copies by a warm-up: it needs token ids

    async def run() -> object:
        async with aiohttp.ClientSession() as session:
            await rep.start(session)
            return rep.sink

    sink = asyncio.run(run())
    assert isinstance(sink, WarmupSink) and sink.publish_on_source
    assert rep.sink_kind("b0") is ReplicationSink.CONNECTOR_STORE


def test_a_dry_run_records_and_releases_every_command() -> None:
    rep, _ = _replicator(_settings(ReplicationSink.DRY_RUN, None))
    assert isinstance(rep.sink, DryRunSink) and rep.prefix_tokens is None
    assert rep.execute([_cmd("b0")]) == []
    (record,) = rep.log
    assert (record.state, record.sink) == ("recorded", "dry_run")
    assert (record.blocks, record.tokens) == (2, 32)
    assert record.as_dict()["command_id"] == "c1"


class _Sink:
    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.seen: list[str] = []

    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        self.seen.append(cmd.command_id)
        return ReplicationResult(cmd.command_id, self.outcome, 0.25, 64, None, 1)


def test_outcomes_land_in_the_log_and_a_waited_pull_is_returned() -> None:
    rep, _ = _replicator(_settings(ReplicationSink.ENGINE, None))

    async def run() -> list[str]:
        rep.sink = _Sink(Outcome.OK)
        waits = rep.execute([_cmd("b0", "c1"), replace(_cmd("b0", "c2"), request_id="r1")])
        assert len(waits) == 1  # only the request's own pull is waited for
        # ... and by a later request that counts on its blocks (Decision.waits_for)
        assert rep.running(["c1", "c2", "gone"]) == waits
        await asyncio.gather(*waits)
        await asyncio.sleep(0)
        assert rep.running(["c2"]) == []  # landed: nothing to wait for
        return [r.state for r in rep.log]

    assert asyncio.run(run()) == ["confirmed", "confirmed"]
    assert rep.log[0].latency_s == 0.25


def test_a_sink_that_did_nothing_is_not_executed() -> None:
    rep, _ = _replicator(_settings(ReplicationSink.ENGINE, None))

    async def run() -> str:
        rep.sink = _Sink(Outcome.NOT_EXECUTED)
        rep.execute([_cmd("b0")])
        for _ in range(10):
            await asyncio.sleep(0)
        return rep.log[-1].state

    assert asyncio.run(run()) == "not_executed"


def test_before_prefill_waits_for_another_requests_pull_it_counts_on() -> None:
    from gateway.openai import ParsedRequest
    from routing.types import Decision, RequestInfo

    rep, _ = _replicator(_settings(ReplicationSink.ENGINE, None))

    def decision(rid: str, pulls: tuple[ReplicationCommand, ...], waits: tuple[str, ...]):
        return Decision(
            rid, "b0", "b0", 0.1, 0.01, 0.0, 0.1, 0.0, 0.0, 64, 32, 64, "kvcache_centric",
            "test", "normal", 30.0, 0.1, replications=pulls, waits_for=waits,
        )  # fmt: skip

    def parsed(rid: str) -> ParsedRequest:
        return ParsedRequest(RequestInfo(rid, 64, (1, 2, 3, 4), 16, 0.0), {}, False)

    class _Held(_Sink):  # a pull that lands when the test says so
        def __init__(self) -> None:
            super().__init__(Outcome.OK)
            self.land = asyncio.Event()

        async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
            await self.land.wait()
            return await super().execute(cmd)

    async def run() -> list[str]:
        sink = rep.sink = _Held()
        order: list[str] = []
        pull = replace(_cmd("b0", "c1"), request_id="a")

        async def send(rid: str, d: Decision) -> None:
            await rep.before_prefill("/v1/completions", parsed(rid), d)
            order.append(rid)

        a = asyncio.create_task(send("a", decision("a", (pull,), ())))
        await asyncio.sleep(0)
        b = asyncio.create_task(send("b", decision("b", (), ("c1",))))
        c = asyncio.create_task(send("c", decision("c", (), ("gone",))))  # landed already
        for _ in range(5):
            await asyncio.sleep(0)
        assert order == ["c"]  # a and b wait for the same pull
        sink.land.set()
        await asyncio.gather(a, b, c)
        return order

    assert asyncio.run(run())[1:] == ["a", "b"]


def test_a_sink_that_raises_fails_the_copy_not_the_requests_waiting_for_it() -> None:
    from gateway.openai import ParsedRequest
    from routing.types import Decision, RequestInfo

    rep, _ = _replicator(_settings(ReplicationSink.ENGINE, None))

    class _Broken(_Sink):
        async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
            raise ConnectionResetError("engine went away mid-copy")

    async def run() -> str:
        rep.sink = _Broken(Outcome.OK)
        pull = replace(_cmd("b0", "c1"), request_id="a")
        d = Decision(
            "a", "b0", "b0", 0.1, 0.01, 0.0, 0.1, 0.0, 0.0, 64, 32, 64, "kvcache_centric",
            "test", "normal", 30.0, 0.1, replications=(pull,),
        )  # fmt: skip
        info = RequestInfo("a", 64, (1, 2, 3, 4), 16, 0.0)
        await rep.before_prefill("/v1/completions", ParsedRequest(info, {}, False), d)
        await asyncio.sleep(0)
        return rep.log[-1].state

    assert asyncio.run(run()) == "failed"  # the request went on; the copy counts as failed
    assert "ConnectionResetError" in (rep.log[-1].error or "")
