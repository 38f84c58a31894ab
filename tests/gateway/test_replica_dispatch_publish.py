"""The replica exchange publishes right after a dispatch (gateway/replica_exchange.py): a peer
sees the request long before the next interval's snapshot, bursts are coalesced per gap, and
closing takes the exchange's hooks off the Conductor. Two exchanges in this process on
loopback, ZMQ picking the ports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import zmq

from config.replica_settings import ReplicasSettings
from gateway.replica_exchange import ReplicaExchange
from gateway.replica_snapshot import decode, encode
from routing.conductor import Conductor
from routing.replica_load import PEER_PREFIX
from routing.types import Decision
from tests.real.engines import free_ports
from tests.routing.fleet import make_conductor, prompt, request

INTERVAL_S = 5.0  # far longer than the tests wait: only a dispatch can publish in time
GAP_S = 0.4  # the dispatch bucket's refill period in the burst test


def _dispatch(c: Conductor, rid: str, family: int, now: float) -> Decision:
    req = request(rid, prompt(family, 128), now=now, max_tokens=100)
    d = c.schedule(req, now)
    assert isinstance(d, Decision)
    c.dispatched(d, req, now)
    return d


def _peer_prefills(c: Conductor) -> int:
    return sum(rid.startswith(PEER_PREFIX) for i in c.instances.values() for rid in i.prefill_queue)


async def _pair(
    on_dispatch: bool, rotate_ties: bool = False
) -> tuple[ReplicaExchange, ReplicaExchange, asyncio.Task]:
    """A publishes (on dispatch or not), B listens; both running, B already knows A."""
    cfg = ReplicasSettings(
        enabled=True,
        bind="tcp://127.0.0.1:*",
        publish_interval_s=INTERVAL_S,
        rotate_ties=rotate_ties,
    )
    a = ReplicaExchange(
        replace(cfg, replica_id="A"),
        make_conductor(prefill=2, decode=2),
        time.monotonic,
        publish_on_dispatch=on_dispatch,
    )
    a.start()
    assert a._pub is not None
    a_bind = a._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    b = ReplicaExchange(
        replace(cfg, replica_id="B", peers=(a_bind,)),
        make_conductor(prefill=2, decode=2),
        time.monotonic,
    )
    b.start()
    task = asyncio.create_task(b.run(asyncio.Event()))
    deadline = time.monotonic() + 10
    while "A" not in b.peers:  # the subscription takes a moment (ZMQ's slow joiner)
        assert time.monotonic() < deadline, "B never heard A"
        a.publish()
        await asyncio.sleep(0.02)
    return a, b, task


async def _seen_within(b: ReplicaExchange, n: int, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if _peer_prefills(b.conductor) >= n:
            return time.monotonic() - t0
        await asyncio.sleep(0.002)
    return None


async def _close(a: ReplicaExchange, b: ReplicaExchange, task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    a.close()
    b.close()


def test_a_dispatch_reaches_the_peer_before_the_next_interval() -> None:
    async def run() -> tuple[float | None, int, int]:
        a, b, task = await _pair(on_dispatch=True)
        try:
            before = a.stats.on_dispatch
            _dispatch(a.conductor, "r1", 1, time.monotonic())
            seen = await _seen_within(b, 1, 1.0)
            return seen, a.stats.on_dispatch - before, b.stats.received
        finally:
            await _close(a, b, task)

    seen, on_dispatch, received = asyncio.run(asyncio.wait_for(run(), 30))
    assert seen is not None and seen < 0.5  # the interval is 5 s
    assert on_dispatch == 1 and received >= 2


def test_without_publish_on_dispatch_the_peer_waits_for_the_interval() -> None:
    async def run() -> float | None:
        a, b, task = await _pair(on_dispatch=False)
        try:
            _dispatch(a.conductor, "r1", 1, time.monotonic())
            return await _seen_within(b, 1, 0.5)
        finally:
            await _close(a, b, task)

    assert asyncio.run(asyncio.wait_for(run(), 30)) is None


def test_a_burst_of_dispatches_is_coalesced_and_the_last_snapshot_holds_all() -> None:
    async def run() -> tuple[int, int, float | None]:
        a, b, task = await _pair(on_dispatch=True)
        try:
            before = a.stats.on_dispatch
            now = time.monotonic()
            # A 0.4 s gap: the five dispatches take far less even on a loaded box (a 50 ms
            # gap refilled a second token there while a compiler ran beside the tests).
            for k in range(5):
                a._tokens, a.gap_s = (1.0, GAP_S) if k == 0 else (a._tokens, GAP_S)
                _dispatch(a.conductor, f"r{k}", k + 1, now)
            immediate = a.stats.on_dispatch - before  # one token: the others wait for the gap
            seen = await _seen_within(b, 5, 2 * GAP_S + 1.0)
            return immediate, a.stats.on_dispatch - before, seen
        finally:
            await _close(a, b, task)

    immediate, total, seen = asyncio.run(asyncio.wait_for(run(), 30))
    assert immediate == 1  # the other four fell in the gap
    assert total == 2  # ... and went out together when it ended
    assert seen is not None and seen < INTERVAL_S  # the gap's publish, not the interval's


def test_a_decision_in_the_same_loop_turn_sees_the_peers_dispatch() -> None:
    """A burst: A dispatches and, before B's event loop runs again, B schedules a request of
    the same size. B catches up inside ``schedule`` and places it elsewhere; without the
    hook (publish_on_dispatch off on both) it herds onto A's instance."""

    async def run(on_dispatch: bool) -> tuple[str, str]:
        a, b, task = await _pair(on_dispatch=on_dispatch)
        b.publish_on_dispatch = on_dispatch
        if not on_dispatch:
            b._unhook_conductor()
        try:
            now = time.monotonic()
            da = _dispatch(a.conductor, "a1", 1, now)
            if not on_dispatch:
                a.publish()  # even a snapshot already on the socket is not read in time
            time.sleep(0.1)  # synchronous: B's receiving task cannot run
            db = _dispatch(b.conductor, "b1", 2, now)
            return da.prefill, db.prefill
        finally:
            await _close(a, b, task)

    a_on, b_on = asyncio.run(asyncio.wait_for(run(True), 30))
    assert a_on != b_on
    a_off, b_off = asyncio.run(asyncio.wait_for(run(False), 30))
    assert a_off == b_off


def test_replicas_deciding_at_the_same_instant_break_ties_on_different_instances() -> None:
    """Two replicas that name each other, with nothing exchanged yet: on an idle fleet both
    see the same tie; with tie rotation (the default) their ranks differ, so their first picks
    differ, prefill and decode; without it both take the first."""
    ports = free_ports(2, lo=20960, hi=20999)  # the replica tests' range (bench/replicas.py)
    eps = [f"tcp://127.0.0.1:{port}" for port in ports]

    async def run(rotate: bool) -> tuple[tuple[str, str], tuple[str, str], list[int]]:
        exchanges = [
            ReplicaExchange(
                ReplicasSettings(
                    enabled=True,
                    replica_id=f"r{k}",
                    bind=eps[k],
                    peers=(eps[1 - k],),
                    publish_on_dispatch=False,
                    rotate_ties=rotate,
                ),
                make_conductor(prefill=2, decode=2),
                time.monotonic,
            )
            for k in (0, 1)
        ]
        try:
            for ex in exchanges:
                ex.start()
            now = time.monotonic()
            d = [_dispatch(ex.conductor, f"r{k}", k, now) for k, ex in enumerate(exchanges)]
            return (
                (d[0].prefill, d[1].prefill),
                (d[0].decode, d[1].decode),
                [ex.rank for ex in exchanges],
            )
        finally:
            for ex in exchanges:
                ex.close()

    (pa, pb), (da, db), ranks = asyncio.run(asyncio.wait_for(run(True), 30))
    assert ranks == [0, 1]  # ports in ascending order: the endpoints sort the same way
    assert pa != pb and da != db
    (pa, pb), (da, db), _ = asyncio.run(asyncio.wait_for(run(False), 30))
    assert pa == pb and da == db


def test_close_takes_the_hooks_off_the_conductor() -> None:
    async def run() -> tuple[bool, int, bool, bool, int]:
        c = make_conductor(prefill=1, decode=1)
        cfg = ReplicasSettings(enabled=True, bind="tcp://127.0.0.1:*", replica_id="A")
        ex = ReplicaExchange(cfg, c, time.monotonic)
        ex.start()
        wrapped = c.after_dispatch == [ex.dispatched] and c.before_schedule == [ex.catch_up]
        _dispatch(c, "r1", 1, 0.0)
        published = ex.stats.on_dispatch
        holds = bool(decode(encode(ex.snapshot(0.0))).work)
        ex.close()
        restored = c.after_dispatch == [] and c.before_schedule == []
        _dispatch(c, "r2", 2, 0.0)  # no hook any more: nothing published, no error
        return wrapped, published, holds, restored, ex.stats.on_dispatch

    assert asyncio.run(run()) == (True, 1, True, True, 1)


def test_publish_on_dispatch_comes_from_config() -> None:
    c = make_conductor(prefill=1, decode=1)
    off = ReplicaExchange(
        ReplicasSettings(enabled=True, publish_on_dispatch=False), c, time.monotonic
    )
    on = ReplicaExchange(ReplicasSettings(enabled=True), c, time.monotonic)
    assert off.publish_on_dispatch is False and on.publish_on_dispatch is True
