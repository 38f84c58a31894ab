"""ServedModels (what /v1/models lists): the configured names and aliases as they are, or, with
no ``models`` table, the engines' own ids, asked at most every refresh interval; an engine
that stops answering leaves the last known list in place."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from config.loader import settings_from_dict
from config.settings import Settings
from gateway.models import ServedModels


def test_engine_ids_are_cached_for_the_refresh_interval() -> None:
    asked = []

    async def models(_: web.Request) -> web.Response:
        asked.append(1)
        if len(asked) > 2:
            return web.Response(status=500)
        return web.json_response({"data": [{"id": f"tiny-{len(asked)}"}]})

    async def main() -> list[list[str]]:
        app = web.Application()
        app.router.add_get("/v1/models", models)
        engine = TestServer(app, host="127.0.0.1")
        await engine.start_server()
        now = [0.0]
        url = str(engine.make_url("")).rstrip("/")
        served = ServedModels(lambda: Settings(), lambda: [url], lambda: now[0], refresh_s=10.0)
        try:
            async with aiohttp.ClientSession() as session:
                out = [await served.ids(session)]
                now[0] = 9.0
                out.append(await served.ids(session))  # cached: the engine is not asked
                now[0] = 10.0
                out.append(await served.ids(session))  # asked again
                now[0] = 25.0
                out.append(await served.ids(session))  # the engine fails: last list kept
                return out
        finally:
            await engine.close()

    out = asyncio.run(main())
    assert out == [["tiny-1"], ["tiny-1"], ["tiny-2"], ["tiny-2"]]
    assert len(asked) == 3


def test_a_models_table_is_listed_without_asking_the_engines() -> None:
    settings = settings_from_dict(
        {
            "models": [{"name": "m1", "aliases": ["m1-alias"], "pools": ["w"]}],
            "pools": [
                {
                    "name": "w",
                    "role": "both",
                    "instances": [{"id": "a", "url": "http://127.0.0.1:9", "model": "m1"}],
                }
            ],
        }
    )
    served = ServedModels(lambda: settings, lambda: ["http://127.0.0.1:9"], lambda: 0.0)
    assert asyncio.run(served.ids(None)) == ["m1", "m1-alias"]
