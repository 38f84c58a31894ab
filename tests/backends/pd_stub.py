"""A recording stub P/D engine for the protocol drivers' tests: every leg it receives, and
the answers a prefill (with or without ``kv_transfer_params``) and a decode give."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.drivers import ForwardPlan, Target

KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "eng-1",
    "remote_request_id": "rid-1",
    "remote_host": "127.0.0.1",
    "remote_port": 1234,
    "tp_size": 1,
}


SSE = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n'


class StubEngine:
    """Records every request; answers as a P/D engine would."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.seen: list[tuple[str, Any, dict[str, Any]]] = []
        self.decode_arrived = asyncio.Event()
        self.fail_with: int | None = None
        self.params: dict[str, Any] | None = KV_PARAMS  # what a prefill answers with
        self.delay_s = 0.0  # before answering
        self.server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, request.headers.copy(), body))
        if self.fail_with:
            return web.json_response({"error": {"message": "boom"}}, status=self.fail_with)
        await asyncio.sleep(self.delay_s)
        if self.role == "prefill":
            if "bootstrap_room" in body:  # SGLang: the prefill waits for its decode partner
                await asyncio.wait_for(self.partner.decode_arrived.wait(), 5)
            answer: dict[str, Any] = {"choices": [{"text": "x"}]}
            if self.params is not None:
                answer["kv_transfer_params"] = self.params
            return web.json_response(answer)
        self.decode_arrived.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE)
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")


async def pair():
    p, d = StubEngine("prefill"), StubEngine("decode")
    p.partner = d
    return p, d, Target("p0", await p.start(), 8998), Target("d0", await d.start())


def forward_plan(p: Target, d: Target, body: dict[str, Any]) -> ForwardPlan:
    return ForwardPlan("rid-1", "/v1/completions", body, p, d, {"X-Request-Id": "rid-1"})


ORIGINAL = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
}
