"""LoRA adapters in front of a real vLLM: a request naming an adapter is keyed in the adapter's
space, as the engine keys its KV.

One vLLM 0.32 (CPU) serving the tiny model and a LoRA adapter of it (engines/make_tiny_lora.py,
``--enable-lora --lora-modules tl=DIR``), KV events over ipc://, behind kvgate with a
``models`` table that lists the adapter (``lora_adapters``). For a chat and a completion
prompt sent to the engine directly under the adapter, the keys kvgate computes for it must all
enter its view from the engine's events alone (``lora_name`` "tl"), and the base model's keys
for the very same prompt must not: through kvgate, the adapter's request then hits its KV on
the engine, and the base model's finds none of it (the engine never reuses an adapter's KV for
the base model; its prefix-cache hit counter does not move).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from config.loader import settings_from_dict
from gateway.app import build_app
from gateway.openai import CHAT, COMPLETIONS
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import (
    ENGINE_SCRIPTS,
    EngineProcess,
    free_ports,
    start_vllm,
    stop_engine,
    vllm_model_dir,
    vllm_python,
    wait_until,
)

pytestmark = pytest.mark.real_engine

ADAPTER = "tl"
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def vllm_lora(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    adapter = tmp_path_factory.mktemp("lora") / ADAPTER
    script = ENGINE_SCRIPTS / "make_tiny_lora.py"
    subprocess.run(
        [str(vllm_python()), str(script), "--model", str(vllm_model_dir()), "--out", str(adapter)],
        check=True,
        timeout=300,
    )
    sock = tmp_path_factory.mktemp("kv-events") / "vllm.sock"
    (port,) = free_ports(1, 18300, 18350)
    lora_args = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}"]
    proc = start_vllm(
        port,
        kv_events_endpoint=f"ipc://{sock}",
        extra_args=[*lora_args, "--max-model-len", "2048"],
    )
    try:
        yield proc
    finally:
        stop_engine(proc)


def _settings(engine: EngineProcess) -> Any:
    return settings_from_dict(
        {
            "server": {"health_interval_s": 10.0, "refit_interval_s": 0},
            "admission": {"mode": "none"},
            "replication": {"enabled": False},
            "models": [
                {
                    "name": engine.model,
                    "pools": ["v"],
                    "model_dir": str(engine.model_dir),
                    "lora_adapters": [ADAPTER],
                }
            ],
            "pools": [
                {
                    "name": "v",
                    "role": "both",
                    "instances": [
                        {
                            "id": "v0",
                            "url": engine.url,
                            "kv_events_endpoint": engine.kv_events_endpoint,
                        }
                    ],
                }
            ],
        }
    )


def test_an_adapters_prompt_is_keyed_as_the_engine_keys_its_kv(vllm_lora: EngineProcess) -> None:
    system = "You answer questions about caches and their prefixes. " * 20
    requests = [
        (CHAT, {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "which engine holds it?"}]}),
        (COMPLETIONS, {"prompt": system + " and a text completion"}),
    ]  # fmt: skip
    app = build_app(_settings(vllm_lora))
    gw = app.gateway

    def keys(path: str, body: dict[str, Any], model: str) -> tuple[int, ...]:
        raw = json.dumps({**body, "model": model}).encode()
        return gw.parse_prompt(path, gw.parse_head(raw), {}, "probe").info.block_hashes

    def held(k: tuple[int, ...]) -> int:
        return sum(gw.conductor.index.holds("v0", h) for h in k)

    async def post(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> None:
        async with s.post(url + path, json={**body, "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()

    async def hits_during(action: Any) -> float:
        before = await asyncio.to_thread(_metric, vllm_lora.url, HITS)
        await action
        return await asyncio.to_thread(_metric, vllm_lora.url, HITS) - before

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with serving(app) as url, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.5)  # the gateway's SUB connects to the ipc:// endpoint
            for i, (path, body) in enumerate(requests):
                lora, base = keys(path, body, ADAPTER), keys(path, body, vllm_lora.model)
                full = len(lora) // 2 * 2  # the engine's full 32-token blocks: 2 own keys each
                # Sent to the engine itself: kvgate learns of it from the KV events alone.
                await post(s, vllm_lora.url, path, {**body, "model": ADAPTER})
                await wait_until(lambda k=lora[:full]: held(k) == len(k))
                seen = {"adapter held": held(lora[:full]), "of": full, "base held": held(base)}
                seen["shared keys"] = len(set(lora) & set(base))
                # Through kvgate, the adapter's request finds its KV on the engine ...
                seen["adapter hits"] = await hits_during(
                    post(s, url, path, {**body, "model": ADAPTER})
                )
                # ... and the base model's, the same prompt, finds none of it.
                seen["base hits"] = await hits_during(
                    post(s, url, path, {**body, "model": vllm_lora.model})
                )
                out[f"{i}:{path}"] = seen
        return out

    out = asyncio.run(asyncio.wait_for(main(), timeout=240))
    print("\nLoRA keys in kvgate's view from the engine's events:", out)
    for name, seen in out.items():
        assert seen["of"] > 10 and seen["adapter held"] == seen["of"], (name, seen)
        assert seen["base held"] == 0 and seen["shared keys"] == 0, (name, seen)
        assert seen["adapter hits"] >= (seen["of"] // 2 - 1) * 32, (name, seen)
        assert seen["base hits"] == 0, (name, seen)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found)
