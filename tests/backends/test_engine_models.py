"""The engines' own model ids, merged; failing engines are skipped."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from backends.engine_models import fetch_served_models


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/models", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def test_merges_the_engines_model_ids_and_skips_failures() -> None:
    async def vllm(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def llama(_: web.Request) -> web.Response:
        body = {"data": [{"id": "tiny"}, {"id": "gguf-tiny"}, {"no": "id"}]}
        return web.json_response(body)

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def main() -> list[str]:
        runners = []
        urls = []
        for h in (vllm, llama, broken):
            r, u = await _serve(h)
            runners.append(r)
            urls.append(u)
        urls.append(f"http://127.0.0.1:{_free_port()}")  # nothing listens
        try:
            async with aiohttp.ClientSession() as session:
                return await fetch_served_models(session, urls, timeout_s=2.0)
        finally:
            for r in runners:
                await r.cleanup()

    assert asyncio.run(main()) == ["gguf-tiny", "tiny"]
