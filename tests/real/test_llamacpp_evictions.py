"""Placement weighs the prefix a llama.cpp slot would lose (routing/llamacpp_slots.py), against
two real llama-servers with one slot each (``-np 1 --cache-ram 0``).

l0's slot holds prefix A, which two requests used; l1's holds U, used once; l0 has idled
longer. A cold prompt C ties on predicted TTFT, and the tie goes to the instance idle longest:
l0, where C overwrites A. Charged with A's recompute, C goes to l1 instead, and the next A
request finds A in l0's slot (the engine's own ``cached_tokens``). With the charge off
(``routing.llamacpp_evict_weight = 0``) the same sequence loses A: the control arm.

Prompts are token ids from the tiny model's vocabulary: kvgate and the engine count alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from gateway.app import build_app
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_llama_server, stop_engine
from tests.real.llama_fleet import llama_settings, token_ids

pytestmark = pytest.mark.real_engine

PREFIX = 640  # tokens of A: 40 blocks of 16


@pytest.fixture
def two_llamas(llamacpp_install: EngineInstall) -> Iterator[list[EngineProcess]]:
    """Fresh engines per arm: each starts with empty slots."""
    engines: list[EngineProcess] = []
    try:
        for port in free_ports(2, 18800, 18850):
            engines.append(start_llama_server(port, slots=1, ctx=2048, cache_ram_mib=0))
        yield engines
    finally:
        for e in engines:
            stop_engine(e)


async def _send(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[str, int]:
    """The instance kvgate placed the prompt on, and the tokens that engine found cached."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        return r.headers["x-kvgate-prefill"], answer["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]


async def _sequence(engines: list[EngineProcess], weight: float) -> dict[str, tuple[str, int]]:
    a, u, c = token_ids(1, PREFIX), token_ids(2, PREFIX), token_ids(3, PREFIX)
    app = build_app(llama_settings(engines, llamacpp_evict_weight=weight))
    async with serving(app) as url, aiohttp.ClientSession() as s:
        book = app.gateway.slot_book
        for _ in range(200):  # the slot layout comes with the first /slots scrape
            if {"l0", "l1"} <= book.instances.keys():
                break
            await asyncio.sleep(0.05)
        assert {"l0", "l1"} <= book.instances.keys(), "llama-server /slots never read"
        seen = {}
        for name, prompt in (
            ("a1", a + token_ids(11, 16)),  # both idle: the first instance
            ("a2", a + token_ids(12, 16)),  # A's holder: A now serves two requests
            ("u", u + token_ids(13, 16)),  # cold: the instance idle longest, l1
            ("c", c + token_ids(14, 16)),  # cold again: a tie, and l0 has idled longer
            ("a3", a + token_ids(15, 16)),
        ):
            seen[name] = await _send(s, url, prompt)
        assert book.held == 0
        return seen


@pytest.mark.parametrize("weight", [1.0, 0.0], ids=["charged", "not_charged"])
def test_a_cold_prompt_does_not_overwrite_a_shared_prefix_when_an_unshared_slot_idles(
    two_llamas: list[EngineProcess], weight: float
) -> None:
    seen = asyncio.run(_sequence(two_llamas, weight))
    assert [seen[k][0] for k in ("a1", "a2", "u")] == ["l0", "l0", "l1"], seen
    assert seen["a2"][1] >= PREFIX - 16, seen  # the engine reused A: it is shared
    if weight:
        assert seen["c"][0] == "l1", seen  # U's slot, not A's
        assert seen["a3"] == ("l0", seen["a3"][1]) and seen["a3"][1] >= PREFIX - 16, seen
    else:
        assert seen["c"][0] == "l0", seen  # the tie: A is overwritten
        assert seen["a3"][1] < PREFIX // 2, seen
