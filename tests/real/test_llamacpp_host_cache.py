"""Does a real llama-server keep a host prompt cache (backends/llamacpp_host_cache.py), and does
the gateway then leave its slots alone (gateway/host_cache_probes.py)? One engine with
``--cache-ram 0``, one with llama-server's host prompt cache on (``--cache-ram 64``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from backends.llamacpp_host_cache import has_host_prompt_cache
from gateway.app import build_app
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_llama_server, stop_engine
from tests.real.llama_fleet import llama_settings

pytestmark = pytest.mark.real_engine


@pytest.fixture
def llamas(llamacpp_install: EngineInstall) -> Iterator[list[EngineProcess]]:
    """[--cache-ram 0, --cache-ram 64], two slots each."""
    engines: list[EngineProcess] = []
    try:
        for port, cache_ram in zip(free_ports(2, 18900, 18950), (0, 64), strict=True):
            engines.append(start_llama_server(port, slots=2, ctx=4096, cache_ram_mib=cache_ram))
        yield engines
    finally:
        for e in engines:
            stop_engine(e)


def test_the_probe_tells_a_host_prompt_cache_from_none(llamas: list[EngineProcess]) -> None:
    async def run() -> list[bool | None]:
        async with aiohttp.ClientSession() as s:
            return [await has_host_prompt_cache(s, e.url, 2) for e in llamas]

    assert asyncio.run(run()) == [False, True]


def test_the_gateway_pins_only_the_engine_without_one(llamas: list[EngineProcess]) -> None:
    app = build_app(llama_settings(llamas, llamacpp_host_cache_probe=True))

    async def run() -> tuple[set[str], set[str]]:
        async with serving(app):
            book = app.gateway.slot_book
            for _ in range(200):
                if book.instances and book.host_cached:
                    break
                await asyncio.sleep(0.05)
            return set(book.instances), set(book.host_cached)

    assert asyncio.run(run()) == ({"l0"}, {"l1"})
