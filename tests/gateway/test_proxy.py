"""The proxy path on real sockets: early rejection, disconnects, engine failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest

from config.settings import AdmissionMode, Settings, SLOSettings
from gateway.stack import LiveStack, StackSpec
from tests.backends.pd_stub import StubEngine


@contextlib.asynccontextmanager
async def _tiny_slo_gateway(
    best_effort: bool, warmup: bool = False, prefill_fails: int | None = None
) -> AsyncIterator[tuple[str, list]]:
    """A gateway in front of two stub engines with a TTFT SLO nothing can meet; yields its
    url and the list of requests the engines saw (prefill's first)."""
    import uvicorn

    from config.loader import settings_from_dict
    from gateway.app import build_app

    p, d = StubEngine("prefill"), StubEngine("decode")
    p.partner = d
    p.fail_with = prefill_fails
    purl, durl = await p.start(), await d.start()
    settings = settings_from_dict(
        {
            "slo": {"ttft_s": 0.0001},  # nothing can meet it
            "admission": {
                "mode": "early",
                "best_effort": {"enabled": best_effort},
                "doomed_warmup": {"enabled": warmup},
            },
            "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
            "pools": [
                {"name": "p", "role": "prefill", "instances": [{"id": "p0", "url": purl}]},
                {"name": "d", "role": "decode", "instances": [{"id": "d0", "url": durl}]},
            ],
        }
    )
    config = uvicorn.Config(
        build_app(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    seen: list = []
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", seen
    finally:
        server.should_exit = True
        await task
        seen.extend(p.seen + d.seen)
        await p.server.close()
        await d.server.close()


def test_rejection_is_fast_shaped_and_touches_no_engine() -> None:
    async def run():
        last = None
        async with (
            _tiny_slo_gateway(best_effort=False) as (url, seen),
            aiohttp.ClientSession() as s,
        ):
            for _ in range(30):
                async with s.post(
                    url + "/v1/completions", json={"prompt": "hello " * 50, "max_tokens": 8}
                ) as r:
                    last = (r.status, dict(r.headers), await r.json())
        return last, seen

    (status, headers, body), engine_requests = asyncio.run(run())
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    assert headers["x-kvgate-reject-reason"] == "ttft_slo"
    assert float(headers["x-kvgate-predicted-ttft-ms"]) > 0
    msg = body["error"]["message"]
    assert "TTFT" in msg and "SLO" in msg and "ms" in msg
    assert body["error"]["code"] == "ttft_slo"
    assert engine_requests == []
    # How fast: bench/rejection_path.py and bench/overload_soak.py --reject-probe (not timed here).


def test_an_idle_fleet_serves_a_doomed_request_best_effort_and_says_so() -> None:
    """The same request with admission.best_effort on (the default): the fleet is idle, so it
    is served late instead of rejected; the answer and the metrics say it was best effort."""

    async def run():
        gateway = _tiny_slo_gateway(best_effort=True)
        async with gateway as (url, seen), aiohttp.ClientSession() as s:
            async with s.post(
                url + "/v1/completions", json={"prompt": "hello " * 50, "max_tokens": 8}
            ) as r:
                answer = (r.status, dict(r.headers), await r.read())
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        return answer, metrics, seen

    (status, headers, body), metrics, engine_requests = asyncio.run(run())
    assert status == 200, body
    assert headers["x-kvgate-admission"] == "best-effort"
    assert float(headers["x-kvgate-predicted-ttft-ms"]) > 0.1  # it misses, and says by how much
    assert "kvgate_best_effort_admissions_total 1.0" in metrics
    assert engine_requests  # it reached the engines


def _spec(**kw) -> StackSpec:
    return StackSpec(prefill=1, decode=1, time_scale=0.02, **kw)


async def _engine_state(stack: LiveStack, iid: str) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.get(stack.emulators[iid].url + "/internal/state") as r,
    ):
        return await r.json()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts_both_legs(stream: bool) -> None:
    """A streamed answer's client leaves after its first bytes; a whole answer's before any
    (its headers come only with its last token, so the gateway is still opening the legs)."""

    async def run():
        # Slower engines for the whole answer: at 0.02 it would be done (~0.3 s) before the
        # client leaves.
        stack = LiveStack(StackSpec(prefill=1, decode=1, time_scale=0.02 if stream else 0.2))
        await stack.start()
        try:
            body = {"prompt": "x " * 200, "max_tokens": 2000, "stream": stream}
            async with aiohttp.ClientSession() as s:
                if stream:
                    resp = await s.post(stack.url + "/v1/completions", json=body)
                    await resp.content.readany()  # the stream has started
                    resp.close()  # the client goes away
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            s.post(stack.url + "/v1/completions", json=body), 0.5
                        )
            for _ in range(100):
                await asyncio.sleep(0.05)
                states = [await _engine_state(stack, i) for i in ("p0", "d0")]
                if all(st["inflight"] == 0 and st["running"] == 0 for st in states):
                    break
            gw = stack.gateway
            books = (
                len(gw.conductor.requests),
                sum(i.batch + len(i.incoming) for i in gw.conductor.instances.values()),
            )
            outcome = gw.learner.decisions[-1].outcome
            return states, books, outcome, gw.metrics.render().decode()
        finally:
            await stack.stop()

    states, books, outcome, metrics = asyncio.run(run())
    assert all(st["inflight"] == 0 and st["running"] == 0 and st["pinned"] == 0 for st in states), (
        states
    )
    assert books == (0, 0)
    assert outcome == "client_disconnected"
    assert 'kvgate_requests_total{outcome="client_disconnected"} 1.0' in metrics
    assert 'kvgate_requests_total{outcome="completed"} 0.0' in metrics


def test_503_when_no_instance_is_healthy() -> None:
    async def run():
        stack = LiveStack(_spec())
        await stack.start()
        try:
            # as a tripped breaker does: the checker, too, must see several good probes before
            # it reports p0 healthy again (else its first probe could re-admit it mid-test)
            stack.gateway.legs.changed("p0", False)
            assert stack.gateway.legs.checker is not None
            stack.gateway.legs.checker.mark_unhealthy("p0")
            async with (
                aiohttp.ClientSession() as s,
                s.post(stack.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r,
            ):
                return r.status, await r.json()
        finally:
            await stack.stop()

    status, body = asyncio.run(run())
    assert status == 503 and body["error"]["code"] == "no_healthy_prefill"


def test_admission_headers_priority_and_slo_overrides() -> None:
    base = replace(
        Settings(),
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
        admission=replace(Settings().admission, mode=AdmissionMode.EARLY),
    )

    async def run():
        stack = LiveStack(_spec(base=base))
        await stack.start()
        try:
            async with aiohttp.ClientSession() as s:
                # A per-request TTFT SLO below what the prefill needs is honoured -> 429.
                async with s.post(
                    stack.url + "/v1/completions",
                    json={"prompt": "word " * 4000, "max_tokens": 2},
                    headers={"x-slo-ttft-ms": "50"},
                ) as r:
                    tight = r.status, r.headers.get("x-kvgate-reject-reason")
                async with s.post(
                    stack.url + "/v1/completions",
                    json={"prompt": "word " * 10, "max_tokens": 2},
                    headers={"x-kvgate-priority": "high"},
                ) as r:
                    ok = r.status
                async with s.post(
                    stack.url + "/v1/completions",
                    json={"prompt": "word", "max_tokens": 2},
                    headers={"x-slo-ttft-ms": "soon"},
                ) as r:
                    bad = r.status
            return tight, ok, bad
        finally:
            await stack.stop()

    tight, ok, bad = asyncio.run(run())
    assert tight == (429, "ttft_slo")
    assert ok == 200 and bad == 400


def test_request_ids_are_unique_32_hex_digits() -> None:
    from gateway.answers import new_request_id

    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_a_retry_avoids_the_instance_whose_connection_failed() -> None:
    import uvicorn
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from config.settings import InstanceSettings, PoolSettings, Role, ServerSettings
    from gateway.app import build_app
    from replay.emulator import EmulatorConfig, start_emulator

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def drop(request: web.Request) -> web.Response:
        assert request.transport is not None
        request.transport.close()  # healthy to the checker, but the request's leg breaks
        return web.Response()

    async def run(pool: tuple[str, ...]) -> tuple[int, str | None, dict]:
        broken_app = web.Application()
        broken_app.router.add_get("/health", healthy)
        broken_app.router.add_post("/v1/completions", drop)
        broken = TestServer(broken_app, host="127.0.0.1")
        await broken.start_server()
        live = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=0.01))
        urls = {"broken": str(broken.make_url("")).rstrip("/"), "live": live.url}
        insts = tuple(InstanceSettings(i, urls[i], Role.BOTH) for i in pool)
        settings = Settings(
            routing=replace(Settings().routing, policy="least_load"),  # ties: the first
            admission=replace(Settings().admission, mode=AdmissionMode.NONE),
            server=ServerSettings(health_interval_s=30.0, refit_interval_s=0, max_retries=1),
            pools=(PoolSettings("w", Role.BOTH, insts),),
        )
        app = build_app(settings)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.post(url + "/v1/completions", json={"prompt": "hi " * 40, "max_tokens": 2}) as r,
            ):
                out = (r.status, r.headers.get("x-kvgate-prefill"), await r.json())
            assert not app.gateway.conductor.requests
            assert app.gateway.conductor.instances["broken"].healthy  # not ejected: avoided
            return out
        finally:
            server.should_exit = True
            await task
            await live.stop()
            await broken.close()

    # Both idle: the first choice is the broken instance (registration order breaks the tie),
    # and so would the retry's be if it did not avoid it.
    status, prefill, _ = asyncio.run(run(("broken", "live")))
    assert (status, prefill) == (200, "live")
    # Nowhere else to go: the client hears the engine failed, not "no capacity".
    status, _, body = asyncio.run(run(("broken",)))
    assert status == 502 and body["error"]["type"] == "upstream_error"
