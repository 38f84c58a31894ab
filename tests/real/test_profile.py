"""`kvgate profile` against a real llama-server: a short sweep (< 60 s) whose fitted prefill
time for a 1k-token cold prompt is within 2x of what that prompt measurably takes."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest

from backends.profile_plan import SweepPlan
from backends.profiler import EngineProfiler
from predictors.calibration import fit_profile
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_llama_server, stop_engine

pytestmark = pytest.mark.real_engine

PLAN = SweepPlan(
    prompt_tokens=(64, 256, 512, 1024, 1536),
    cached_fractions=(0.0, 0.5),
    batch_sizes=(1, 2),
    decode_contexts=(256,),
    repeats=1,
    decode_tokens=12,
    max_seconds=45.0,
    max_requests=60,
)


@pytest.fixture(scope="module")
def llama(llamacpp_install: EngineInstall) -> Iterator[EngineProcess]:
    (port,) = free_ports(1, 18560, 18599)
    proc = start_llama_server(port, slots=2, ctx=8192, cache_ram_mib=0)
    yield proc
    stop_engine(proc)


async def _cold_ttft_s(url: str, n: int, seed: int) -> float:
    rng = random.Random(seed)
    body = {
        "prompt": [rng.randrange(10, 1000) for _ in range(n)],
        "max_tokens": 1,
        "stream": True,
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        t0 = time.perf_counter()
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                if raw.startswith(b"data:"):
                    return time.perf_counter() - t0
    raise AssertionError("no streamed chunk")


def test_short_sweep_predicts_a_cold_1k_prompt_within_2x(llama: EngineProcess) -> None:
    async def sweep():
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await EngineProfiler(session, llama.url, llama.model, PLAN).run()

    started = time.monotonic()
    result = asyncio.run(sweep())
    assert time.monotonic() - started < 60
    assert result.token_ids and result.errors == 0, result.last_error
    # llama.cpp reports the reused prefix (timings.cache_n): partly cached samples exist.
    assert any(s.cached_tokens > 0 for s in result.samples if s.batch == 0)
    cal = fit_profile(result.samples, name="llama", model=llama.model, target=llama.url)
    predicted_s = cal.profile.prefill.gpu_ms(1024, 0) / 1000
    measured_s = statistics.median(
        asyncio.run(_cold_ttft_s(llama.url, 1024, seed)) for seed in range(3)
    )
    assert measured_s / 2 <= predicted_s <= measured_s * 2, (predicted_s, measured_s)
