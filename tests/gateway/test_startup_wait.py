"""The gateway opens for traffic once it knows its llama.cpp slots (``server.startup_wait_s``):
a real Gateway in front of a fake llama-server (its metrics, ``/slots`` and a ``/completion``
that answers the host-cache probe late, as an engine busy with a first prefill does). The
times compared are 0.1 s, 1 s and 6 s apart, so that a slow machine does not decide them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from aiohttp import web

from config.loader import settings_from_dict
from config.settings import Settings
from gateway.runtime import Gateway
from tests.backends.fake_http import serving_routes
from tests.backends.test_llamacpp_host_cache import FakeLlamaServer

DATA = Path(__file__).parents[1] / "backends" / "data"
METRICS = (DATA / "llamacpp_metrics_busy.txt").read_text()
SLOTS = (DATA / "llamacpp_slots_busy.json").read_text()
PROBE_DELAY_S = 1.0  # wide margins: the assertions compare it with startup times


def _settings(url: str, wait_s: float) -> Settings:
    return settings_from_dict(
        {
            "server": {"startup_wait_s": wait_s, "scrape_interval_s": 0.2, "refit_interval_s": 0},
            "admission": {"mode": "none"},
            "replication": {"enabled": False},
            "pools": [
                {
                    "name": "llama",
                    "role": "both",
                    "instances": [{"id": "l0", "url": url, "engine": "llamacpp"}],
                }
            ],
        }
    )


def _start(wait_s: float) -> tuple[bool, float, bool]:
    """(slots booked when startup returned, seconds startup took, slots booked later)."""
    engine = FakeLlamaServer(2, host_cache=False)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def slots(_: web.Request) -> web.Response:
        return web.Response(text=SLOTS)

    async def completion(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(PROBE_DELAY_S / 4)  # four probe prompts: two slots + 2
        return await engine.completion(request)

    async def run() -> tuple[bool, float, bool]:
        async with serving_routes(
            ("GET", "/metrics", metrics),
            ("GET", "/slots", slots),
            ("POST", "/completion", completion),
        ) as url:
            gw = Gateway(_settings(url, wait_s))
            t0 = time.monotonic()
            await gw.startup()
            took = time.monotonic() - t0
            at_start = "l0" in gw.slot_book.instances
            for _ in range(250):
                if "l0" in gw.slot_book.instances:
                    break
                await asyncio.sleep(0.02)
            later = "l0" in gw.slot_book.instances
            await gw.shutdown()
            return at_start, took, later

    return asyncio.run(asyncio.wait_for(run(), timeout=20))


def test_the_gateway_starts_once_its_llamacpp_slots_are_known():
    at_start, took, _ = _start(6.0)
    assert at_start  # the first request is pinned to a slot
    assert PROBE_DELAY_S <= took < 6.0  # it waited for the probe's answer, not the budget


def test_without_the_wait_the_first_requests_meet_an_empty_slot_book():
    at_start, took, later = _start(0.0)
    assert not at_start and later  # the answer came, but after the port opened
    assert took < PROBE_DELAY_S


def test_the_wait_is_bounded():
    at_start, took, later = _start(0.1)
    assert not at_start and later
    assert 0.1 <= took < PROBE_DELAY_S
