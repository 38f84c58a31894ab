"""llama.cpp slot pinning behind a real Envoy: `kvgate epp` in front of one real llama-server
(``-np 2 --cache-ram 0``) rewrites a request's body with the ``id_slot`` of the slot holding
its prefix, as `kvgate serve` does (tests/real/test_engine_feedback.py -k repeat_waits, the
same scenario). Slot x holds prefix A, slot y prefix B; two A requests arrive together. Pinned,
the second waits for x and B survives in y; left to the engine, it takes y and B is gone."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from config.settings import AdmissionMode, EngineKind, InstanceSettings, Role, Settings
from tests.gateway.epp.envoy_stack import envoy_stack, require_envoy
from tests.real.engines import EngineProcess
from tests.real.llama_fleet import token_ids
from tests.real.test_engine_feedback import PREFIX, two_prefixes_then_a_collision
from tests.real.test_engine_feedback import llama as llama  # the same 2-slot llama-server

pytestmark = pytest.mark.real_engine
STREAM = {"stream": True}


def _spec(engine: EngineProcess, affinity: bool, buffered: bool, workdir: Path):
    from gateway.epp.stack import EppStackSpec

    base = Settings()
    base = replace(
        base,
        # --cache-ram 0; the probe's prompts would overwrite the slots the test fills
        routing=replace(
            base.routing, llamacpp_slot_affinity=affinity, llamacpp_host_cache_probe=False
        ),
        admission=replace(base.admission, mode=AdmissionMode.NONE),
        server=replace(base.server, scrape_interval_s=0.2, refit_interval_s=0),
    )
    inst = InstanceSettings("l0", engine.url, Role.BOTH, engine=EngineKind.LLAMACPP)
    return EppStackSpec(
        instances=(inst,), block_size=16, kv_events=False, health_interval_s=2.0,
        fallbacks=0, fail_open=buffered, workdir=workdir, base=base,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("affinity", "buffered"),
    [(True, False), (True, True), (False, False)],
    ids=["slot_affinity", "slot_affinity_buffered", "engine_picks"],
)
def test_behind_envoy_a_repeat_waits_for_its_busy_slot_instead_of_evicting_the_other(
    llama: EngineProcess, affinity: bool, buffered: bool, tmp_path: Path
) -> None:
    """``buffered``: the fail-open config, whose request bodies Envoy buffers: the rewrite
    is a body mutation there, not a re-streamed body."""
    require_envoy()
    seed = 600 + 100 * (not affinity) + 50 * buffered

    async def run(url: str) -> int:
        async with aiohttp.ClientSession() as s:
            return await two_prefixes_then_a_collision(s, url, seed)

    with envoy_stack(_spec(llama, affinity, buffered, tmp_path)) as ts:
        book = ts.gateway.slot_book
        for _ in range(100):  # the first /slots scrape tells the gateway the layout
            if ts.call(lambda: "l0" in book.instances) or not affinity:
                break
            ts.run(asyncio.sleep(0.05))
        assert ts.call(lambda: "l0" in book.instances) == affinity
        cached = asyncio.run(run(ts.url))
        assert ts.wait_books_empty(10.0) == (0, 0)
        assert ts.call(lambda: book.held) == 0  # every pin let go
    if affinity:
        assert cached >= PREFIX - 16, cached  # B stayed in its slot
    else:
        assert cached < PREFIX // 2, cached  # the engine gave B's slot to the second A


def test_streamed_answers_through_envoy_all_arrive(llama: EngineProcess, tmp_path: Path) -> None:
    # llama-server closes its connection after each streamed answer without saying so; an
    # Envoy that reused such a connection answered 503 "connection termination" to 9 % of
    # these (gateway/epp/envoy.py). The stack's Envoy takes one request per connection here.
    require_envoy()

    async def run(url: str) -> list[tuple[int, bytes]]:
        gate = asyncio.Semaphore(4)
        async with aiohttp.ClientSession() as s:

            async def one(i: int) -> tuple[int, bytes]:
                body = {"model": "tiny", "prompt": token_ids(800 + i % 3, 300), "max_tokens": 2}
                async with gate, s.post(f"{url}/v1/completions", json=body | STREAM) as r:
                    answer = await r.read()
                    return r.status, answer[-14:] if r.status == 200 else answer[:200]

            return await asyncio.gather(*(one(i) for i in range(40)))

    with envoy_stack(_spec(llama, True, False, tmp_path)) as ts:
        answers = asyncio.run(run(ts.url))
        assert ts.wait_books_empty(10.0) == (0, 0)
    assert answers == [(200, b"data: [DONE]\n\n")] * 40
