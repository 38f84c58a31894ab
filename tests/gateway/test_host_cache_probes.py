"""gateway/host_cache_probes.py with a real SlotBook and a fake llama-server
(tests/backends/test_llamacpp_host_cache.py's): an engine without a host prompt cache gets its
slots booked, one with it never, one that cannot answer is asked again later."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from gateway.host_cache_probes import MAX_TRIES, RETRY_S, HostCacheProbes
from routing.llamacpp_slots import SlotBook
from tests.backends.fake_http import serving_routes
from tests.backends.test_llamacpp_host_cache import FakeLlamaServer


def _run(
    engines: dict[str, FakeLlamaServer], step_s: float = 0.0
) -> tuple[SlotBook, HostCacheProbes]:
    """Three scrapes of every engine, the gateway's clock ``step_s`` apart."""
    now = [0.0]

    async def run() -> tuple[SlotBook, HostCacheProbes]:
        async with contextlib.AsyncExitStack() as stack:
            urls = {
                iid: await stack.enter_async_context(
                    serving_routes(("POST", "/completion", engine.completion))
                )
                for iid, engine in engines.items()
            }
            s = await stack.enter_async_context(aiohttp.ClientSession())
            book = SlotBook()
            probes = HostCacheProbes(book, urls.get, lambda: s, lambda: now[0])
            try:
                for _ in range(3):
                    for iid, engine in engines.items():
                        probes.slots_seen(iid, engine.slots)
                    for _ in range(100):
                        if not probes._tasks:
                            break
                        await asyncio.sleep(0.01)
                    now[0] += step_s
            finally:
                await probes.close()
        return book, probes

    return asyncio.run(run())


def test_only_engines_without_a_host_cache_get_their_slots_pinned():
    on, off = FakeLlamaServer(2, host_cache=True), FakeLlamaServer(2, host_cache=False)
    book, probes = _run({"on": on, "off": off})
    assert probes.answers == {"on": True, "off": False}
    assert set(book.instances) == {"off"} and book.host_cached == {"on"}
    assert book.assign("r", "on", (1, 2), 0.0) is None
    assert book.assign("s", "off", (1, 2), 0.0) is not None
    # asked once: slots + 2 requests, not three times that
    assert on.requests == off.requests == 2 + 2


def test_an_engine_that_cannot_answer_is_asked_again_after_a_while():
    refusing = FakeLlamaServer(2, host_cache=False, status=503)
    book, probes = _run({"r": refusing})
    assert probes.answers == {} and book.instances == {}
    assert refusing.requests == 1  # three scrapes, one try: the next after RETRY_S
    assert probes._retry_at["r"] == RETRY_S


def test_an_engine_that_never_answers_is_assumed_to_keep_no_host_cache():
    refusing = FakeLlamaServer(2, host_cache=False, status=503)
    book, probes = _run({"r": refusing}, step_s=RETRY_S + 1)
    assert refusing.requests == MAX_TRIES == 3
    assert probes.answers == {"r": False} and "r" in book.instances
