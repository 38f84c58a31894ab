"""HealthChecker against a real aiohttp server on 127.0.0.1 that can be switched between
healthy and unhealthy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, unused_port

from backends.health import HealthChecker

T = TypeVar("T")


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=15))


async def _until(cond: Callable[[], bool], timeout_s: float = 3.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


# --- HealthChecker ------------------------------------------------------------------------


@dataclass
class Engines:
    base: str
    healthy: dict[str, bool]
    release: asyncio.Event
    calls: dict[str, int] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@asynccontextmanager
async def engines(*names: str) -> AsyncIterator[Engines]:
    """/{name}/health answers 200 or 503 per ``healthy[name]``; /hang/health never answers."""
    state = {n: True for n in names}
    release = asyncio.Event()
    calls: dict[str, int] = {}

    async def health(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        calls[name] = calls.get(name, 0) + 1
        if name == "hang":
            with suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), timeout=5)
        return web.Response(status=200 if state.get(name, True) else 503)

    app = web.Application()
    app.router.add_get("/{name}/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield Engines(str(server.make_url("")).rstrip("/"), state, release, calls)
    finally:
        release.set()
        await server.close()


def test_transitions_need_consecutive_results_after_the_first() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        async with engines("a") as e, aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"a": e.url("a")},
                interval_s=0.05,
                timeout_s=0.5,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: 7.0,
            )
            assert hc.healthy("a") is None
            assert await hc.check_once() == {"a": True}
            assert changes == [("a", True)]  # the first answer decides an unknown target
            e.healthy["a"] = False
            for _ in range(2):
                assert await hc.check_once() == {"a": True}  # 1 and 2 failures: still in
            assert await hc.check_once() == {"a": False}
            assert changes[-1] == ("a", False)
            assert hc.status["a"].last_error == "HTTP 503" and hc.status["a"].last_checked_s == 7.0
            e.healthy["a"] = True
            assert await hc.check_once() == {"a": False}
            e.healthy["a"] = False  # a single success in between resets the count
            await hc.check_once()
            e.healthy["a"] = True
            await hc.check_once()
            assert await hc.check_once() == {"a": True}
            assert changes == [("a", True), ("a", False), ("a", True)]

    arun(main())


def test_timeouts_and_refused_connections_are_failures_probed_concurrently() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        async with engines("ok") as e, aiohttp.ClientSession() as session:
            targets = {
                "ok": e.url("ok"),
                "hang": e.url("hang"),
                "refused": f"http://127.0.0.1:{unused_port()}",
            }
            hc = HealthChecker(
                session,
                targets,
                interval_s=1.0,
                timeout_s=0.2,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: 0.0,
            )
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await hc.check_once() == {"ok": True, "hang": False, "refused": False}
            assert loop.time() - started < 1.0  # one timeout for the round, not one per target
            assert sorted(changes) == [("hang", False), ("ok", True), ("refused", False)]
            assert (hc.status["hang"].last_error or "").startswith("timeout")
            assert (hc.status["refused"].last_error or "").startswith("ClientConnector")

    arun(main())


def test_run_loop_and_live_target_changes() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        stop = asyncio.Event()

        def on_change(instance_id: str, ok: bool) -> None:
            changes.append((instance_id, ok))
            if (instance_id, ok) == ("b", False):
                stop.set()
            if instance_id == "a":
                raise RuntimeError("consumer bug")  # must not stop the checker

        async with engines("a", "b") as e, aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"a": e.url("a")},
                interval_s=0.02,
                timeout_s=0.5,
                unhealthy_after=2,
                on_change=on_change,
                clock=lambda: 0.0,
            )
            task = asyncio.create_task(hc.run(stop))
            await _until(lambda: bool(changes))
            hc.set_targets({"b": e.url("b")})  # a removed, b added while running
            assert hc.healthy("a") is None
            await _until(lambda: ("b", True) in changes)
            e.healthy["b"] = False
            await asyncio.wait_for(task, timeout=3)
            assert changes[0] == ("a", True)
            assert changes[-2:] == [("b", True), ("b", False)]
            assert e.calls["b"] >= 3

    arun(main())


def test_mark_unhealthy_requires_consecutive_successes_to_come_back() -> None:
    async def run() -> list[tuple[str, bool]]:
        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/health", ok)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        changes: list[tuple[str, bool]] = []
        async with aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"a": str(server.make_url("/")).rstrip("/")},
                interval_s=0.05,
                timeout_s=1.0,
                healthy_after=2,
                on_change=lambda i, h: changes.append((i, h)),
                clock=lambda: 0.0,
            )
            await hc.check_once()
            hc.mark_unhealthy("a")
            assert hc.healthy("a") is False
            await hc.check_once()
            assert hc.healthy("a") is False  # one success is not enough
            await hc.check_once()
            assert hc.healthy("a") is True
        await server.close()
        return changes

    assert asyncio.run(run())[-1] == ("a", True)


# --- refused vs slow (issue 12) -------------------------------------------------------------


def test_a_refused_connection_ejects_at_once_a_slow_answer_only_after_three() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        now = [0.0]
        async with engines("slow") as e, aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"slow": e.url("slow"), "gone": e.url("gone")},
                interval_s=1.0,
                timeout_s=0.1,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: now[0],
            )
            assert await hc.check_once() == {"slow": True, "gone": True}
            # "gone" stops listening: the next probe is refused and ejects it at once.
            hc.set_targets({"slow": e.url("hang"), "gone": f"http://127.0.0.1:{unused_port()}"})
            hc._health["slow"].healthy = True  # same instance, now answering late
            now[0] = 1.0
            # One refused probe ejects; one late answer does not.
            assert await hc.check_once() == {"slow": True, "gone": False}
            assert ("gone", False) in changes
            now[0] = 2.0
            assert (await hc.check_once())["slow"] is True  # a second late answer: still in
            now[0] = 3.0
            assert (await hc.check_once())["slow"] is False
            assert (hc.status["slow"].last_error or "").startswith("timeout (0.1 s)")

    arun(main())


def test_late_probes_do_not_eject_an_engine_that_answers_real_traffic() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        now = [0.0]
        async with engines("hang") as e, aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"busy": e.url("hang")},
                interval_s=1.0,
                timeout_s=0.05,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: now[0],
            )
            hc._health["busy"].healthy = True
            for t in range(1, 6):
                now[0] = float(t)
                hc.mark_alive("busy", now[0] - 0.5)  # a request got its answer meanwhile
                assert (await hc.check_once())["busy"] is True
            assert changes == []
            # Traffic stops getting answers: the late probes count again.
            for t in range(6, 9):
                now[0] = float(t)
                await hc.check_once()
            assert changes == [("busy", False)]

    arun(main())


def test_probe_now_probes_one_instance_once_at_a_time() -> None:
    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        async with engines("a") as e, aiohttp.ClientSession() as session:
            hc = HealthChecker(
                session,
                {"a": e.url("a"), "dead": f"http://127.0.0.1:{unused_port()}"},
                interval_s=60.0,
                timeout_s=1.0,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: 0.0,
            )
            assert hc.probe_now("unknown") is None
            first = hc.probe_now("dead")
            assert first is not None and hc.probe_now("dead") is first  # deduplicated
            await first
            assert changes == [("dead", False)]
            task = hc.probe_now("a")
            assert task is not None
            await task
            assert e.calls == {"a": 1} and hc.healthy("a") is True
            hc.cancel_probes()

    arun(main())


def test_set_timing_validates_and_applies() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            hc = HealthChecker(session, {}, on_change=lambda i, ok: None, clock=lambda: 0.0)
            hc.set_timing(3.0, 7.5)
            assert (hc.interval_s, hc.timeout_s, hc.recheck_s) == (3.0, 7.5, 1.0)
            hc.set_timing(0.5, 1.0, 2.0)
            assert hc.recheck_s == 0.5  # never rarer than a full round
            with pytest.raises(ValueError):
                hc.set_timing(1.0, 0.0)
            with pytest.raises(ValueError):
                hc.set_timing(1.0, 1.0, 0.0)

    arun(main())


def test_an_ejected_instance_is_rechecked_between_rounds_and_rejoins_in_seconds() -> None:
    """Rounds 60 s apart, rechecks 20 ms apart: an engine back from a stall is routed to again
    after two quick passes, not two rounds later; the healthy one is not probed in between."""

    async def main() -> None:
        changes: list[tuple[str, bool]] = []
        stop = asyncio.Event()
        async with engines("a", "b") as e, aiohttp.ClientSession() as session:
            e.healthy["a"] = False
            hc = HealthChecker(
                session,
                {"a": e.url("a"), "b": e.url("b")},
                interval_s=60.0,
                timeout_s=0.5,
                recheck_s=0.02,
                on_change=lambda i, ok: changes.append((i, ok)),
                clock=lambda: 0.0,
            )
            task = asyncio.create_task(hc.run(stop))
            try:
                await _until(lambda: ("a", False) in changes)
                assert hc.ejected() == ["a"]
                await _until(lambda: e.calls["a"] >= 4)  # rechecked, still failing: still out
                assert hc.healthy("a") is False
                e.healthy["a"] = True
                await _until(lambda: ("a", True) in changes, timeout_s=2.0)
                assert hc.ejected() == []
                assert e.calls["b"] == 1  # only the first round probed the healthy one
            finally:
                stop.set()
                await asyncio.wait_for(task, timeout=3)

    arun(main())
