"""backends/llamacpp_host_cache.py against a fake llama-server that models its slot choice
(least recently used slot, as for unpinned requests) with and without a host prompt cache."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from backends.llamacpp_host_cache import has_host_prompt_cache, probe_prompt
from tests.backends.fake_http import serving_routes


@dataclass
class FakeLlamaServer:
    slots: int
    host_cache: bool
    status: int = 200
    held: list[str] = field(default_factory=list)  # each slot's prompt, least recent first
    saved: set[str] = field(default_factory=set)
    requests: int = 0

    async def completion(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        prompt = (await request.json())["prompt"]
        n = len(prompt.split())
        if prompt in self.held:
            cached = n - 1
            self.held.remove(prompt)
        else:
            if len(self.held) >= self.slots:
                old = self.held.pop(0)
                if self.host_cache:
                    self.saved.add(old)
            cached = n - 1 if prompt in self.saved else 0
        self.held.append(prompt)
        return web.json_response({"timings": {"cache_n": cached, "prompt_n": n - cached}})


def _ask(engine: FakeLlamaServer, slots: int) -> bool | None:
    async def run() -> bool | None:
        async with (
            serving_routes(("POST", "/completion", engine.completion)) as url,
            aiohttp.ClientSession() as s,
        ):
            return await has_host_prompt_cache(s, url, slots, 5.0)

    return asyncio.run(run())


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_a_prompt_pushed_out_of_every_slot_comes_back_only_from_a_host_cache(slots: int):
    assert _ask(FakeLlamaServer(slots, host_cache=True), slots) is True
    assert _ask(FakeLlamaServer(slots, host_cache=False), slots) is False


def test_an_engine_that_refuses_the_probe_leaves_the_answer_open():
    assert _ask(FakeLlamaServer(2, host_cache=True, status=503), 2) is None


def test_probe_prompts_share_no_first_word():
    firsts = {probe_prompt(i).split()[0] for i in range(9)}
    assert len(firsts) == 9
