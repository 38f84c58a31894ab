"""The engine's own view routes: a prefix a client cached on one real vLLM *without* kvgate
draws the gateway's requests for it to that engine, and an eviction takes it out again.

Two vLLM 0.32 (CPU) engines, KV events over ipc://, a small KV pool each
(``--num-gpu-blocks-override 96``, engine block 32), behind one gateway (kvcache_centric,
gateway block 16, the tiny model's own chat template and tokenizer). For each engine in turn a
prompt is sent to that engine directly while the gateway runs: only its ``BlockStored``
events can tell kvgate about it. A request through kvgate that shares the prompt's prefix
must go to that engine (``x-kvgate-prefill``), and the engines' own
``vllm:prefix_cache_hits_total`` must show the hit there and nothing on the other. Then the
holder's pool is flooded directly; its ``BlockRemoved`` events must take the prefix out of
the gateway's view.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from config.loader import settings_from_dict
from gateway.app import build_app
from routing.tokenizer import unpack_token_ids
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine, wait_until
from tests.real.replication_harness import vllm_metric
from tests.real.test_kv_event_keys import ENGINE_BS, POOL_BLOCKS, token_prompt

pytestmark = pytest.mark.real_engine

HITS = "vllm:prefix_cache_hits_total"
SYSTEM = "You answer from the engine that already holds this long system prompt. " * 30


@pytest.fixture(scope="module")
def vllm_two(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProcess]]:
    tmp = tmp_path_factory.mktemp("view-routing")
    engines: list[EngineProcess] = []
    pool = ["--num-gpu-blocks-override", str(POOL_BLOCKS), "--max-model-len", "2048"]
    try:
        for i, port in enumerate(free_ports(2, 18400, 18440)):
            events = f"ipc://{tmp / f'v{i}.sock'}"
            engines.append(
                start_vllm(port, kv_events_endpoint=events, block_size=ENGINE_BS, extra_args=pool)
            )
        yield engines
    finally:
        for e in engines:
            stop_engine(e)


def _settings(engines: list[EngineProcess]) -> Any:
    instances = [
        {"id": f"v{i}", "url": e.url, "kv_events_endpoint": e.kv_events_endpoint}
        for i, e in enumerate(engines)
    ]
    return settings_from_dict(
        {
            # No refits and no health churn: the routing must come from the view alone.
            "server": {"health_interval_s": 10.0, "refit_interval_s": 0},
            "admission": {"mode": "none"},
            "replication": {"enabled": False},
            "routing": {"block_size": 16, "model_dir": str(engines[0].model_dir)},
            "pools": [{"name": "workers", "role": "both", "instances": instances}],
        }
    )


def _chat(question: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
    }


def test_a_prefix_cached_without_kvgate_draws_its_requests_and_eviction_drops_it(
    vllm_two: list[EngineProcess], tmp_path: Path
) -> None:
    app = build_app(_settings(vllm_two))
    gw = app.gateway
    model = vllm_two[0].model
    # v1 gets a chat conversation's system prompt, v0 a token-id prompt: each engine holds
    # one prefix that only its own events announced.
    cases = [
        ("v1", "/v1/chat/completions", _chat("asked directly"), _chat("asked through kvgate")),
        ("v0", "/v1/completions", {"prompt": token_prompt(640, 4242), "max_tokens": 1},
         {"prompt": token_prompt(640, 4242) + token_prompt(64, 99), "max_tokens": 1}),
    ]  # fmt: skip
    report: list[dict[str, Any]] = []

    def keys(path: str, body: dict[str, Any]) -> tuple[int, ...]:
        """kvgate's keys for the body's full engine blocks."""
        tokens = unpack_token_ids(gw.prompt_encoder.encode(path, body).packed)
        full = tokens[: len(tokens) // ENGINE_BS * ENGINE_BS]
        return tuple(gw.hasher.hash_tokens(full))

    async def post(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> str:
        async with s.post(url + path, json={**body, "model": model}) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return r.headers.get("x-kvgate-prefill", "")

    async def main() -> None:
        index = gw.conductor.index
        async with serving(app) as url, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)  # the gateway's SUB sockets connect to the ipc:// endpoints
            for holder, path, direct, routed in cases:
                engine = vllm_two[int(holder[1])]
                other = vllm_two[1 - int(holder[1])]
                await post(s, engine.url, path, direct)  # not through kvgate
                want = keys(path, direct)
                seen = await wait_until(lambda w=want, h=holder: all(index.holds(h, k) for k in w))
                assert seen, f"{holder}'s events never brought the direct prompt into the view"
                before = (vllm_metric(engine.url, HITS), vllm_metric(other.url, HITS))
                went = await post(s, url, path, routed)
                after = (vllm_metric(engine.url, HITS), vllm_metric(other.url, HITS))
                shared = sum(1 for a, b in zip(want, keys(path, routed), strict=False) if a == b)
                report.append(
                    {"holder": holder, "routed_to": went, "shared_blocks": shared,
                     "holder_hits": after[0] - before[0], "other_hits": after[1] - before[1]}
                )  # fmt: skip
            # Flood v0's pool directly: its events must take the token-id prefix out.
            prefix = keys(cases[1][1], cases[1][2])
            for i in range(6):
                body = {"prompt": token_prompt(640, 7000 + 97 * i), "max_tokens": 1}
                await post(s, vllm_two[0].url, "/v1/completions", body)
            evicted = await wait_until(lambda: not index.holds("v0", prefix[0]))
            report.append({"evicted_from_view": evicted})

    asyncio.run(asyncio.wait_for(main(), timeout=300))
    print("\nengine-view routing:", report)
    for row in report[:2]:
        assert row["routed_to"] == row["holder"], row
        assert row["shared_blocks"] >= 10, row  # a real shared prefix, not a template header
        # The engine's own counter: every shared full engine block was a hit there.
        assert row["holder_hits"] >= (row["shared_blocks"] // 2 - 1) * ENGINE_BS, row
        assert row["other_hits"] == 0, row
    assert report[2]["evicted_from_view"], "the flood's evictions never left the view"
