"""`kvgate replay`'s open-loop client against a streaming stub on 127.0.0.1: outcomes measured,
and progress reported as answers end, not only once every request has been sent."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web
from aiohttp.test_utils import TestServer

from replay.live.loadgen import LoadOptions, run_load
from replay.report.results import Outcome
from replay.workload.traces import TraceRequest

CHUNK = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for _ in range(body["max_tokens"]):
        await asyncio.sleep(0.002)
        await resp.write(CHUNK)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def test_every_request_is_measured_and_progress_moves_while_sending() -> None:
    trace = [TraceRequest(i, 0.1 * i, 64, 3, (i,)) for i in range(6)]  # sent over 0.5 s
    calls: list[tuple[int, int, float]] = []

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", _completions)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        t0 = time.perf_counter()

        def progress(done: int, total: int) -> None:
            calls.append((done, total, time.perf_counter() - t0))

        try:
            opts = LoadOptions(str(server.make_url("")).rstrip("/"), timeout_s=10)
            return await run_load(trace, opts, progress)
        finally:
            await server.close()

    result = asyncio.run(main())
    assert [r.outcome for r in result.requests] == [Outcome.COMPLETED] * 6
    assert all(r.ttft_s is not None and r.generated == 3 for r in result.requests)
    assert [c[:2] for c in calls] == [(k, 6) for k in range(1, 7)]
    # the first answer is counted long before the last request (at 0.5 s) is sent
    assert calls[0][2] < 0.4, calls


def test_the_model_field_is_sent_only_when_given() -> None:
    """A made-up name would be a 404 at a real engine: none by default (the engine's own model),
    the given one with ``--model``."""
    trace = [TraceRequest(0, 0.0, 16, 1, (0,))]

    async def models_sent(model: str | None) -> list[object]:
        seen: list[object] = []

        async def completions(request: web.Request) -> web.StreamResponse:
            seen.append((await request.json()).get("model", "<none>"))
            return await _completions(request)

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            await run_load(trace, LoadOptions(url, model=model, timeout_s=10))
        finally:
            await server.close()
        return seen

    assert asyncio.run(models_sent(None)) == ["<none>"]
    assert asyncio.run(models_sent("tiny")) == ["tiny"]
