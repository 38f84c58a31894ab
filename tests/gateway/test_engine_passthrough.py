"""``POST /tokenize`` and ``/detokenize`` reach one healthy instance of the body's model as the
client sent them, and come back as the engine answered (gateway/engine_passthrough.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from config.loader import settings_from_dict
from gateway.app import build_app
from gateway.serve import start_server


class TokenizerEngine:
    """Answers /tokenize and /detokenize with its name and what it was sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[tuple[str, bytes]] = []
        self.server: TestServer | None = None

    async def tokenize(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.seen.append((request.path, raw))
        return web.json_response({"engine": self.name, "tokens": [1, 2, 3]}, status=200)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")


async def _run(models: bool, check) -> Any:
    a, b = TokenizerEngine("a"), TokenizerEngine("b")
    urls = [await a.start(), await b.start()]
    table: dict[str, Any] = {
        "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
        "pools": [
            {"name": "pa", "role": "both", "instances": [{"id": "a0", "url": urls[0]}]},
            {"name": "pb", "role": "both", "instances": [{"id": "b0", "url": urls[1]}]},
        ],
    }
    if models:
        table["models"] = [
            {"name": "model-a", "pools": ["pa"]},
            {"name": "model-b", "pools": ["pb"]},
        ]
    app = build_app(settings_from_dict(table))
    server = await start_server(app, "127.0.0.1", 0, lifespan="on")
    try:
        async with aiohttp.ClientSession() as s:
            return await check(server.url, s, app.gateway), a.seen, b.seen
    finally:
        await server.stop()
        for e in (a, b):
            assert e.server is not None
            await e.server.close()


async def _post(s: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, Any]:
    headers = {"content-type": "application/json"}
    async with s.post(url, data=raw, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_the_body_reaches_its_models_engine_unchanged_and_the_answer_comes_back() -> None:
    raw = b'{"model": "model-b", "prompt": "hello",  "add_special_tokens": false}'

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        return [await _post(s, url + path, raw) for path in ("/tokenize", "/detokenize")]

    answers, seen_a, seen_b = asyncio.run(_run(True, check))
    assert answers == [(200, {"engine": "b", "tokens": [1, 2, 3]})] * 2
    assert seen_a == [] and seen_b == [("/tokenize", raw), ("/detokenize", raw)]


def test_errors_are_openai_shaped() -> None:
    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        unknown = await _post(s, url + "/tokenize", b'{"model": "nope", "prompt": "x"}')
        no_model = await _post(s, url + "/tokenize", b'{"prompt": "x"}')
        bad = await _post(s, url + "/tokenize", b"{not json")
        for iid in ("b0",):  # no healthy instance of model-b
            gw.legs.changed(iid, False)
        down = await _post(s, url + "/tokenize", b'{"model": "model-b", "prompt": "x"}')
        return unknown, no_model, bad, down

    (unknown, no_model, bad, down), _, _ = asyncio.run(_run(True, check))
    assert unknown[0] == 404 and unknown[1]["error"]["code"] == "model_not_found"
    assert no_model[0] == 400 and no_model[1]["error"]["param"] == "model"  # two models
    assert bad[0] == 400 and bad[1]["error"]["message"] == "request body is not valid JSON"
    assert down[0] == 503 and down[1]["error"]["code"] == "no_healthy"


def test_without_a_models_table_any_healthy_engine_answers() -> None:
    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        return await _post(s, url + "/tokenize", b'{"content": "llama.cpp style"}')

    (status, body), seen_a, seen_b = asyncio.run(_run(False, check))
    assert status == 200 and body["engine"] in ("a", "b")
    assert len(seen_a) + len(seen_b) == 1
