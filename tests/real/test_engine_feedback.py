"""kvgate in front of one real llama-server (``-np 2 --cache-ram 0``): its metrics are
understood (running/waiting, the slot layout as KV capacity), a prompt too long for the TTFT SLO
is served best effort on the idle engine (or, with best effort off, refused and its prompt
warmed in the engine all the same), a prompt longer than the context
gets the engine's 400 and leaves nothing in the cache view, the engine's cached-token reports
keep kvgate's hit ratio close to the engine's own, and slot affinity (``id_slot``) keeps a hot
prefix from evicting the other slot's.

Prompts are token ids drawn from the tiny model's vocabulary, so kvgate and the engine count
the same tokens without tokenizer files.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from config.settings import (
    AdmissionMode,
    EngineKind,
    InstanceSettings,
    PoolSettings,
    Role,
    Settings,
)
from gateway.app import GatewayApp, build_app
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_llama_server, stop_engine
from tests.real.llama_fleet import token_ids

pytestmark = pytest.mark.real_engine

SLOT_CTX = 2048


@pytest.fixture(scope="module")
def llama(llamacpp_install: EngineInstall) -> Iterator[EngineProcess]:
    (port,) = free_ports(1, 18300, 18350)
    proc = start_llama_server(port, slots=2, ctx=2 * SLOT_CTX, cache_ram_mib=0)
    yield proc
    stop_engine(proc)


def _settings(
    engine: EngineProcess,
    slot_affinity: bool = True,
    ttft_slo_s: float | None = None,
    best_effort: bool = True,
) -> Settings:
    base = Settings()
    inst = InstanceSettings("l0", engine.url, Role.BOTH, engine=EngineKind.LLAMACPP)
    mode = AdmissionMode.NONE if ttft_slo_s is None else AdmissionMode.EARLY
    admission = replace(
        base.admission,
        mode=mode,
        best_effort=replace(base.admission.best_effort, enabled=best_effort),
    )
    return replace(
        base,
        slo=base.slo if ttft_slo_s is None else replace(base.slo, ttft_s=ttft_slo_s),
        routing=replace(
            base.routing,
            block_size=16,
            llamacpp_slot_affinity=slot_affinity,
            llamacpp_host_cache_probe=False,  # --cache-ram 0; the probe would overwrite slots
        ),
        admission=admission,
        pools=(PoolSettings("llama", Role.BOTH, (inst,)),),
        server=replace(base.server, scrape_interval_s=0.2, refit_interval_s=0),
    )


@asynccontextmanager
async def _gateway(
    engine: EngineProcess,
    slot_affinity: bool = True,
    ttft_slo_s: float | None = None,
    best_effort: bool = True,
) -> AsyncIterator[tuple[GatewayApp, str]]:
    app = build_app(_settings(engine, slot_affinity, ttft_slo_s, best_effort))
    async with serving(app) as url:
        yield app, url


async def _complete(
    s: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    stream: bool = False,
    max_tokens: int = 2,
) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with s.post(url + "/v1/completions", json=body) as r:
        raw = await r.read()
    if not stream:
        return r.status, json.loads(raw)
    events = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    return r.status, next(e for e in events if e.get("usage"))


def _gauge(metrics: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", metrics, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_metrics_and_slot_capacity_are_understood(llama: EngineProcess) -> None:
    async def run() -> tuple[Any, int, str]:
        async with _gateway(llama) as (app, url), aiohttp.ClientSession() as s:
            gw = app.gateway
            assert gw.scraper is not None
            for _ in range(100):
                await asyncio.sleep(0.05)
                load = gw.scraper.latest("l0", gw.clock())
                if load is not None and gw.conductor.instances["l0"].capacity_tokens < 10**5:
                    break
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
            return load, gw.conductor.instances["l0"].capacity_tokens, metrics

    load, capacity, metrics = asyncio.run(run())
    assert load is not None and load.engine == "llamacpp" and load.understood
    assert load.num_running is not None and load.num_waiting is not None
    assert (load.slots, load.capacity_tokens) == (2, 2 * SLOT_CTX)
    assert capacity == 2 * SLOT_CTX  # the engine's, not the H100 profile's
    assert 'kvgate_engine_metrics_understood{instance="l0"} 1.0' in metrics


def test_an_idle_engine_serves_a_prompt_too_long_for_the_slo_best_effort(
    llama: EngineProcess,
) -> None:
    """A 1 ms TTFT SLO that no prompt can meet: on the idle engine the request is served best
    effort (the engine answers it; the gateway says so) instead of a 429 nobody benefits from."""

    async def run() -> tuple[int, dict[str, str], dict[str, Any], str]:
        gateway = _gateway(llama, ttft_slo_s=0.001)
        async with gateway as (_, url), aiohttp.ClientSession() as s:
            body = {"model": "tiny", "prompt": token_ids(7, 600), "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                answer = r.status, dict(r.headers), await r.json()
            async with s.get(url + "/metrics") as r:
                return *answer, await r.text()

    status, headers, body, metrics = asyncio.run(run())
    assert status == 200, body
    assert headers["x-kvgate-admission"] == "best-effort"
    assert body["usage"]["prompt_tokens"] == 600  # the engine ran the prompt
    assert "kvgate_best_effort_admissions_total 1.0" in metrics


def test_a_doomed_request_is_refused_and_its_prompt_warmed_in_the_engine(
    llama: EngineProcess,
) -> None:
    """The same 1 ms TTFT SLO with best effort off: the client hears 429 at once, and the
    prompt is prefilled on the idle engine all the same (admission.doomed_warmup), so that
    the next request sharing it finds it in the engine's own cache."""
    prompt = token_ids(8, 600)

    async def run() -> tuple[int, dict[str, Any], str, int, dict[str, Any]]:
        gateway = _gateway(llama, ttft_slo_s=0.001, best_effort=False)
        async with gateway as (app, url), aiohttp.ClientSession() as s:
            status, refused = await _complete(s, url, prompt)
            for _ in range(200):  # the warm-up runs after the 429, bounded wait
                async with s.get(url + "/metrics") as r:
                    metrics = await r.text()
                if 'kvgate_doomed_warmups_total{outcome="ok"} 1.0' in metrics:
                    break
                await asyncio.sleep(0.05)
            in_flight = len(app.gateway.conductor.requests)
            # The next request sharing the prompt, straight to the engine (which picks the
            # slot holding the most similar prompt): what did the warm-up leave cached?
            body = {"model": "tiny", "prompt": prompt + token_ids(9, 20), "max_tokens": 2}
            async with s.post(llama.url + "/v1/completions", json=body) as r:
                again = await r.json()
        return status, refused, metrics, in_flight, again

    status, refused, metrics, in_flight, again = asyncio.run(run())
    assert status == 429 and refused["error"]["code"] == "ttft_slo"
    assert 'kvgate_doomed_warmups_total{outcome="ok"} 1.0' in metrics
    assert in_flight == 0  # the warm-up's books are closed
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 590, again["usage"]


def test_a_prompt_longer_than_the_context_leaves_nothing_recorded(llama: EngineProcess) -> None:
    too_long = token_ids(99, SLOT_CTX + 500)

    async def run() -> list[tuple[int, dict[str, Any], tuple[int, int]]]:
        out = []
        async with _gateway(llama) as (app, url), aiohttp.ClientSession() as s:
            c = app.gateway.conductor
            # Repeats must not believe an earlier attempt cached anything, and a client's
            # oversized prompts must not eject the engine (10 failures open its breaker).
            for _ in range(12):
                status, body = await _complete(s, url, too_long)
                out.append((status, body, c.index.blocks_held("l0")))
            assert not c.requests
            assert c.instances["l0"].healthy
        return out

    for status, body, held in asyncio.run(run()):
        assert status == 400, body
        assert body["error"]["type"] == "exceed_context_size_error"
        assert held == (0, 0)


def test_engine_reports_keep_kvgate_hit_ratio_close_to_the_engines(llama: EngineProcess) -> None:
    # Four ~600-token system prompts, two slots: the engine keeps about two of them, so a view
    # that never learned evictions would believe far more hits than the engine delivers.
    systems = [token_ids(s, 600) for s in range(4)]
    rng = random.Random(7)
    order = [rng.choice((0, 0, 0, 1, 1, 2, 3)) for _ in range(30)]

    async def run() -> tuple[int, int, int, str]:
        predicted = engine = prompt = 0
        async with _gateway(llama) as (app, url), aiohttp.ClientSession() as s:
            for i, which in enumerate(order):
                status, answer = await _complete(
                    s, url, systems[which] + token_ids(1000 + i, 40), stream=i % 2 == 1
                )
                assert status == 200, answer
                engine += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt += answer["usage"]["prompt_tokens"]
            records = list(app.gateway.learner.decisions)
            predicted = sum(r.cached_tokens for r in records)
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        return predicted, engine, prompt, metrics

    predicted, engine, prompt, metrics = asyncio.run(run())
    kvgate_ratio = _gauge(metrics, "kvgate_cache_hit_ratio")
    engine_ratio = _gauge(metrics, "kvgate_engine_cache_hit_ratio")
    print(
        f"\nkvgate predicted {predicted} cached tokens, engine reported {engine} of {prompt}: "
        f"kvgate_cache_hit_ratio {kvgate_ratio:.3f}, engine {engine_ratio:.3f}"
    )
    assert engine_ratio == pytest.approx(engine / prompt, abs=0.02)
    assert engine_ratio > 0.2  # the workload does hit the cache
    assert abs(kvgate_ratio - engine_ratio) <= 0.1, (kvgate_ratio, engine_ratio)
    # evictions learned: from the engine's reports, or up front from the slots kvgate reused
    learned = _gauge(metrics, "kvgate_cache_view_dropped_blocks_total")
    learned += _gauge(metrics, "kvgate_cache_view_slot_evicted_blocks_total")
    assert learned > 0


PREFIX = 800  # tokens of each prefix in the slot collision scenario


async def two_prefixes_then_a_collision(s: aiohttp.ClientSession, url: str, seed: int) -> int:
    """Prefix A into one slot, B into the other, two A requests together, then B again: the
    tokens the engine found cached for that last B (of its ``PREFIX`` tokens)."""
    a, b = token_ids(seed + 1, PREFIX), token_ids(seed + 2, PREFIX)
    for prompt in (a, b):
        status, _ = await _complete(s, url, prompt + token_ids(seed + 3, 20))
        assert status == 200
    answers = await asyncio.gather(
        _complete(s, url, a + token_ids(seed + 4, 20), max_tokens=200),
        _complete(s, url, a + token_ids(seed + 5, 20)),
    )
    assert [st for st, _ in answers] == [200, 200]
    status, again = await _complete(s, url, b + token_ids(seed + 6, 20))
    assert status == 200
    return again["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("affinity", [True, False], ids=["slot_affinity", "engine_picks"])
def test_a_repeat_waits_for_its_busy_slot_instead_of_evicting_the_other(
    llama: EngineProcess, affinity: bool
) -> None:
    # Slot x holds prefix A, slot y prefix B. Two A requests arrive together: llama-server alone
    # gives the second the idle slot y (overwriting B); pinned to x, it waits and B survives.
    seed = 400 if affinity else 500

    async def run() -> int:
        async with _gateway(llama, affinity) as (app, url), aiohttp.ClientSession() as s:
            book = app.gateway.slot_book
            for _ in range(100):
                if "l0" in book.instances or not affinity:
                    break
                await asyncio.sleep(0.05)
            assert ("l0" in book.instances) == affinity
            cached = await two_prefixes_then_a_collision(s, url, seed)
            assert book.held == 0  # every pin released
            return cached

    cached = asyncio.run(run())
    if affinity:
        assert cached >= PREFIX - 16, cached  # B stayed in its slot
    else:
        assert cached < PREFIX // 2, cached  # the engine gave B's slot to the second A
