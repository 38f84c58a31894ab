"""Engines that refuse, go silent, or die mid-stream behind a live gateway (issue 12 item 2): a
refused connection ejects the instance at once, a silent engine is aborted after the silence
timeout (which follows prediction and SLO within bounds), a killed one is ejected at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp

from config.settings import (
    InstanceSettings,
    PoolSettings,
    PredictorSettings,
    Role,
    RoutingSettings,
    ServerSettings,
    Settings,
)
from gateway.app import build_app
from replay.emulator import EmulatorConfig, start_emulator
from tests.gateway.live import serving


@contextlib.asynccontextmanager
async def _gateway(settings: Settings):
    """The gateway app under uvicorn on an ephemeral loopback port; yields (app, url)."""
    app = build_app(settings)
    async with serving(app) as url:
        yield app, url


def _colocated(insts: dict[str, str], **server: object) -> Settings:
    from dataclasses import replace

    from config.settings import AdmissionMode, AdmissionSettings, SLOSettings

    return Settings(
        slo=SLOSettings(ttft_s=0.2),
        routing=RoutingSettings(policy="least_load"),  # ties: registration order
        admission=AdmissionSettings(mode=AdmissionMode.NONE),
        predictors=PredictorSettings(profile="llama3-8b-h100-tp1"),
        server=replace(ServerSettings(refit_interval_s=0), **server),  # type: ignore[arg-type]
        pools=(
            PoolSettings(
                "w",
                Role.BOTH,
                tuple(InstanceSettings(i, url, Role.BOTH) for i, url in insts.items()),
            ),
        ),
    )


async def _read_sse(r: aiohttp.ClientResponse) -> tuple[int, list[dict], bool]:
    tokens, errors, done = 0, [], False
    async for line in r.content:
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data: {"):
            data = json.loads(line[6:])
            if "error" in data:
                errors.append(data["error"])
            elif data.get("choices"):
                tokens += 1
    return tokens, errors, done


def test_a_refused_engine_is_ejected_by_one_request_and_keeps_nothing_cached() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from backends.circuit_breaker import BreakerState

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def run():
        dead_app = web.Application()
        dead_app.router.add_get("/health", healthy)
        dead = TestServer(dead_app, host="127.0.0.1")
        await dead.start_server()
        live = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=0.01))
        dead_url = str(dead.make_url("")).rstrip("/")
        settings = _colocated({"dead": dead_url, "live": live.url}, health_interval_s=30.0)
        try:
            async with _gateway(settings) as (app, url):
                gw = app.gateway
                for _ in range(300):  # the first probe round has seen both answer
                    if gw.legs.checker.healthy("dead") and gw.legs.checker.healthy("live"):
                        break
                    await asyncio.sleep(0.01)
                await dead.close()  # nothing listens on its port any more: refused
                t0 = time.monotonic()
                async with aiohttp.ClientSession() as s:
                    body = {"prompt": "refused " * 40, "max_tokens": 2, "stream": True}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        first = (r.status, r.headers.get("x-kvgate-prefill"), await _read_sse(r))
                ejected_after = time.monotonic() - t0
                dead_state = gw.conductor.instances["dead"]
                out = {
                    "first": first,
                    "ejected": not dead_state.healthy,
                    "ejected_after_s": ejected_after,
                    "breaker": gw.legs.breakers["dead"].state_at(gw.clock()),
                    "checker": gw.legs.checker.healthy("dead"),
                    "cached_on_dead": gw.conductor.index.blocks_held("dead"),
                    "outcomes": sorted(r.outcome for r in gw.learner.decisions),
                    "books": (len(gw.conductor.requests), gw.drain.active),
                }
                # The next request goes straight to the live engine (no failed attempt).
                async with aiohttp.ClientSession() as s:
                    body = {"prompt": "next " * 40, "max_tokens": 2}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        out["next"] = (r.status, r.headers.get("x-kvgate-prefill"))
                out["retries"] = gw.metrics.retries._value.get()
                return out
        finally:
            await live.stop()

    out = asyncio.run(asyncio.wait_for(run(), 30))
    status, prefill, (tokens, errors, done) = out["first"]
    assert (status, prefill, errors, done) == (200, "live", [], True) and tokens >= 1
    assert out["ejected"] and out["ejected_after_s"] < 1.0
    assert out["breaker"] is BreakerState.OPEN and out["checker"] is False
    assert out["cached_on_dead"] == (0, 0)  # the refused attempt left no prefix there
    assert out["outcomes"] == ["completed", "failed"]  # no record stays in_flight
    assert out["books"] == (0, 0)
    assert out["next"] == (200, "live") and out["retries"] == 1


def _silent_engine(mode: str):
    """An engine that answers /health but goes silent on a completion: ``before_headers``
    sends nothing at all; ``after_headers`` sends the SSE headers, then nothing (vLLM's
    shape); ``mid_stream`` sends one token, then nothing; ``slow_whole`` is not silent but
    slow: a whole (non-streamed) answer after 1.5 s, as a long generation arrives."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def complete(request: web.Request) -> web.StreamResponse:
        await request.read()
        if mode == "slow_whole":
            await asyncio.sleep(1.5)
            choice = {"index": 0, "text": "x" * 16, "finish_reason": "length"}
            return web.json_response({"object": "text_completion", "choices": [choice]})
        if mode != "before_headers":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if mode == "mid_stream":
                chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await asyncio.sleep(30)  # silent; the gateway aborts long before
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", complete)
    return app


def test_a_silent_engine_is_aborted_after_the_silence_timeout() -> None:
    from aiohttp.test_utils import TestServer

    async def run(mode: str, stream: bool, max_tokens: int = 4):
        engine = TestServer(_silent_engine(mode), host="127.0.0.1")
        await engine.start_server()
        # SLO 0.2 s: the timeout is max(4 x predicted, 2 x 0.2 s) within 0.5..0.8 s.
        settings = _colocated(
            {"silent": str(engine.make_url("")).rstrip("/")},
            health_interval_s=30.0,
            silence_slo_factor=2.0,
            silence_min_s=0.5,
            silence_max_s=0.8,
            max_retries=1,
        )
        try:
            async with _gateway(settings) as (app, url), aiohttp.ClientSession() as s:
                gw = app.gateway
                t0 = time.monotonic()
                body = {"prompt": "quiet " * 40, "max_tokens": max_tokens, "stream": stream}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status == 200 and stream:
                        answer: object = await _read_sse(r)
                    else:
                        answer = await r.json()
                    status = r.status
                took = time.monotonic() - t0
                now = gw.clock()
                return {
                    "status": status,
                    "answer": answer,
                    "took": took,
                    "breaker_failures": gw.legs.breakers["silent"].recent_failures(now),
                    "outcomes": [r.outcome for r in gw.learner.decisions],
                    "books": (len(gw.conductor.requests), gw.drain.active),
                }
        finally:
            await engine.close()

    for mode, stream in (("before_headers", False), ("after_headers", True)):
        out = asyncio.run(asyncio.wait_for(run(mode, stream), 20))
        # Nothing reached the client: a plain OpenAI-shaped 504, not retried.
        assert out["status"] == 504, (mode, out)
        assert out["answer"]["error"]["type"] == "upstream_timeout"
        assert out["answer"]["error"]["code"] == "engine_silent"
        assert 0.4 < out["took"] < 3.0, out
        assert out["breaker_failures"] == 1 and out["outcomes"] == ["failed"]
        assert out["books"] == (0, 0)
    out = asyncio.run(asyncio.wait_for(run("mid_stream", True), 20))
    tokens, errors, done = out["answer"]
    assert out["status"] == 200 and tokens == 1 and done
    assert [e["code"] for e in errors] == ["engine_silent"]
    assert out["breaker_failures"] == 1 and out["outcomes"] == ["failed"]
    assert out["books"] == (0, 0)
    # A whole answer past the 0.8 s ceiling is not cut: its 16 tokens x 2 x 0.1 s TBT SLO
    # add 3.2 s (the 504 before the fix).
    out = asyncio.run(asyncio.wait_for(run("slow_whole", False, max_tokens=16), 20))
    assert out["status"] == 200 and out["answer"]["choices"][0]["text"] == "x" * 16, out
    assert out["breaker_failures"] == 0 and out["outcomes"] == ["completed"]
    assert out["books"] == (0, 0)


class _RawEngine:
    """A bare asyncio HTTP engine: /health answers 200; a completion streams a token every
    20 ms until ``kill()`` drops every connection and stops listening (as SIGKILL does)."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if head.startswith(b"GET /health"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                await writer.drain()
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            event = b'data: {"choices":[{"index":0,"text":"x","finish_reason":null}]}\n\n'
            for _ in range(1000):
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.02)

    def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.transport.abort()


def test_an_engine_killed_mid_stream_is_ejected_at_once_not_a_health_interval_later() -> None:
    async def run():
        engine = _RawEngine()
        spare = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=0.01))
        # A 30 s health interval: only the failure path can eject it in time.
        urls = {"doomed": await engine.start(), "spare": spare.url}
        settings = _colocated(urls, health_interval_s=30.0)
        try:
            async with _gateway(settings) as (app, url), aiohttp.ClientSession() as s:
                gw = app.gateway
                for _ in range(300):
                    if gw.legs.checker.healthy("doomed") and gw.legs.checker.healthy("spare"):
                        break
                    await asyncio.sleep(0.01)
                body = {"prompt": "doomed " * 40, "max_tokens": 500, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    on = r.headers.get("x-kvgate-prefill")
                    await r.content.readline()  # the stream is flowing
                    engine.kill()
                    t0 = time.monotonic()
                    _, errors, done = await _read_sse(r)
                while gw.conductor.instances["doomed"].healthy and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.005)
                ejected_after = time.monotonic() - t0
                books = (len(gw.conductor.requests), gw.drain.active)
                return on, errors, done, ejected_after, books
        finally:
            await spare.stop()

    on, errors, done, ejected_after, books = asyncio.run(asyncio.wait_for(run(), 30))
    assert on == "doomed" and done and [e["type"] for e in errors] == ["upstream_error"]
    assert ejected_after < 1.0, ejected_after  # the health interval is 30 s
    assert books == (0, 0)
