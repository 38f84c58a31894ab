"""MetricsScraper against a real aiohttp server on 127.0.0.1: healthy, hanging and failing
targets scraped concurrently, staleness, live target changes and the periodic loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer, unused_port

from backends.prometheus import EngineLoad
from backends.scraper import MetricsScraper

DATA = Path(__file__).parent / "data"
VLLM = (DATA / "vllm_v1_dp2_metrics.txt").read_text()
SGLANG = (DATA / "sglang_dp2_metrics.txt").read_text()
LLAMA = (DATA / "llamacpp_metrics_busy.txt").read_text()
LLAMA_SLOTS = (DATA / "llamacpp_slots_busy.json").read_text()
LLAMA_PROPS = (DATA / "llamacpp_props.json").read_text()
T = TypeVar("T")


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=15))


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Fleet:
    base: str
    release: asyncio.Event
    hits: dict[str, int] = field(default_factory=dict)

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"


@asynccontextmanager
async def fleet() -> AsyncIterator[Fleet]:
    """One server, one path prefix per pretend engine: /vllm, /sglang, /hang, /err, /bad."""
    release = asyncio.Event()
    hits: dict[str, int] = {}

    async def metrics(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        hits[name] = hits.get(name, 0) + 1
        if name == "hang":  # accepts, then never answers within any scrape timeout
            with suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), timeout=5)
        if name == "err":
            return web.Response(status=500, text="engine dead")
        if name == "bad":
            return web.Response(text="vllm:num_requests_running{engine=0 garbage\n")
        body = SGLANG if name == "sglang" else VLLM
        return web.Response(text=body, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/{name}/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield Fleet(str(server.make_url("")).rstrip("/"), release, hits)
    finally:
        release.set()  # let the hanging handler finish so shutdown is immediate
        await server.close()


def test_scrape_all_is_concurrent_and_isolates_failures() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            targets = {
                "v": f.url("vllm"),
                "s": f.url("sglang"),
                "hang": f.url("hang"),
                "err": f.url("err"),
                "bad": f.url("bad"),
                "refused": f"http://127.0.0.1:{unused_port()}",
            }
            scraper = MetricsScraper(session, targets, timeout_s=0.3, clock=clock)
            started = time.monotonic()
            out = await scraper.scrape_all()
            elapsed = time.monotonic() - started
            assert set(out) == set(targets)
            v, s = out["v"], out["s"]
            assert isinstance(v, EngineLoad) and isinstance(s, EngineLoad)
            assert (v.engine, v.num_running, v.scraped_at_s) == ("vllm", 12, 1000.0)
            assert (s.engine, s.num_running) == ("sglang", 44)
            for name in ("hang", "err", "bad", "refused"):
                assert out[name] is None, name
                assert scraper.errors(name) == 1, name
                assert scraper.latest(name, clock.now) is None
            assert scraper.errors("v") == 0 and scraper.stats["v"].scrapes == 1
            assert scraper.stats["err"].last_error == "_ScrapeFailed: HTTP 500"
            assert scraper.stats["hang"].last_error == "TimeoutError"
            assert "MetricsParseError" in (scraper.stats["bad"].last_error or "")
            # The hanging target costs one timeout, not one per target.
            assert elapsed < 1.5, elapsed

    arun(main())


def test_latest_goes_stale_and_a_failure_keeps_the_old_snapshot() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            scraper = MetricsScraper(
                session, {"v": f.url("vllm")}, stale_after_s=5.0, clock=clock, timeout_s=0.5
            )
            assert scraper.latest("v", clock.now) is None  # never scraped
            await scraper.scrape_all()
            first = scraper.latest("v", clock.now)
            assert first is not None and first.scraped_at_s == 1000.0
            assert scraper.latest("v", 1005.0) is first  # exactly at the limit: still fresh
            # Target starts failing: the old snapshot is kept until it ages out.
            scraper.set_targets({"v": f.url("err")})
            clock.now = 1003.0
            assert (await scraper.scrape_all())["v"] is None
            assert scraper.latest("v", 1004.0) is first
            assert scraper.latest("v", 1005.1) is None
            assert scraper.latest("unknown-instance", 1000.0) is None

    arun(main())


def test_targets_can_change_while_running() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            scraper = MetricsScraper(session, {"a": f.url("vllm")}, clock=clock, timeout_s=0.5)
            assert set(await scraper.scrape_all()) == {"a"}
            scraper.set_targets({"a": f.url("vllm") + "/", "b": f.url("sglang")})
            out = await scraper.scrape_all()
            assert set(out) == {"a", "b"} and out["b"] is not None
            scraper.set_targets({"b": f.url("sglang")})
            assert scraper.latest("a", clock.now) is None and "a" not in scraper.stats
            assert set(await scraper.scrape_all()) == {"b"}
            assert scraper.targets == {"b": f.url("sglang")}

    arun(main())


def test_removal_during_an_in_flight_scrape_discards_its_result() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            scraper = MetricsScraper(
                session, {"h": f.url("hang"), "v": f.url("vllm")}, clock=clock, timeout_s=2.0
            )
            task = asyncio.create_task(scraper.scrape_all())
            for _ in range(200):  # wait until the hanging request reached the server
                if f.hits.get("hang"):
                    break
                await asyncio.sleep(0.01)
            scraper.set_targets({"v": f.url("vllm")})
            f.release.set()
            await task
            assert "h" not in scraper.stats and scraper.latest("h", clock.now) is None

    arun(main())


def test_run_loop_scrapes_periodically_until_stopped() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            scraper = MetricsScraper(
                session, {"v": f.url("vllm"), "e": f.url("err")}, clock=clock, timeout_s=0.5
            )
            stop = asyncio.Event()
            rounds: list[dict[str, EngineLoad | None]] = []

            def on_scrape(result: dict[str, EngineLoad | None]) -> None:
                rounds.append(result)
                clock.now += 1.0
                if len(rounds) == 3:
                    stop.set()

            await asyncio.wait_for(scraper.run(0.05, stop, on_scrape), timeout=5)
            assert len(rounds) == 3
            assert f.hits["vllm"] == 3 and scraper.errors("e") == 3
            assert all(r["v"] is not None and r["e"] is None for r in rounds)

    arun(main())


@asynccontextmanager
async def llama_fleet() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """llama-server look-alikes serving captured pages: /slots on (``/withslots``) or off
    (``/noslots``: 501 as with --no-slots, so /props must answer)."""
    hits: dict[str, int] = {}

    async def page(request: web.Request) -> web.StreamResponse:
        name, what = request.match_info["name"], request.match_info["what"]
        hits[f"{name}/{what}"] = hits.get(f"{name}/{what}", 0) + 1
        if what == "metrics":
            return web.Response(text=LLAMA, content_type="text/plain")
        if what == "slots" and name == "withslots":
            return web.Response(text=LLAMA_SLOTS, content_type="application/json")
        if what == "props":
            return web.Response(text=LLAMA_PROPS, content_type="application/json")
        return web.Response(status=501, text="This server does not support slots endpoint.")

    app = web.Application()
    app.router.add_get("/{name}/{what}", page)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), hits
    finally:
        await server.close()


def test_llamacpp_slot_layout_gives_capacity_read_once() -> None:
    async def main() -> None:
        clock = FakeClock()
        async with llama_fleet() as (base, hits), aiohttp.ClientSession() as session:
            targets = {"a": f"{base}/withslots", "b": f"{base}/noslots"}
            scraper = MetricsScraper(session, targets, clock=clock, engines={"b": "llamacpp"})
            for _ in range(3):
                out = await scraper.scrape_all()
            a, b = out["a"], out["b"]
            assert a is not None and b is not None
            assert (a.engine, a.slots, a.capacity_tokens, a.num_running) == ("llamacpp", 2, 4096, 1)
            assert (b.slots, b.capacity_tokens) == (2, 4096)  # from /props
            assert hits["withslots/metrics"] == 3 and hits["withslots/slots"] == 1
            assert hits["noslots/slots"] == 1 and hits["noslots/props"] == 1
            assert scraper.stats["a"].engine == "llamacpp" and scraper.stats["a"].understood

    arun(main())


def test_openai_engines_are_not_scraped() -> None:
    async def main() -> None:
        async with fleet() as f, aiohttp.ClientSession() as session:
            targets = {"v": f.url("vllm"), "o": f.url("sglang")}
            scraper = MetricsScraper(session, targets, clock=FakeClock(), engines={"o": "openai"})
            assert set(await scraper.scrape_all()) == {"v"}
            assert "sglang" not in f.hits and scraper.stats["o"].scrapes == 0

    arun(main())


def test_a_page_with_nothing_understood_is_logged_once_and_shown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        clock = FakeClock()
        async with fleet() as f, aiohttp.ClientSession() as session:
            # An sglang page read as vLLM (a wrong engine setting): nothing matches.
            scraper = MetricsScraper(
                session, {"s": f.url("sglang")}, clock=clock, engines={"s": "vllm"}
            )
            for _ in range(3):
                load = (await scraper.scrape_all())["s"]
                assert load is not None and not load.understood
            stats = scraper.stats["s"]
            assert (stats.scrapes, stats.engine, stats.understood) == (3, "vllm", False)

    with caplog.at_level(logging.WARNING, logger="backends.scraper"):
        arun(main())
    warnings = [r for r in caplog.records if "no load signal was understood" in r.getMessage()]
    assert len(warnings) == 1 and "instance s" in warnings[0].getMessage()
