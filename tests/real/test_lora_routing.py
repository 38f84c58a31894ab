"""LoRA adapters in front of a real vLLM: a request naming an adapter is keyed in the adapter's
space, as the engine keys its KV.

One vLLM 0.32 (CPU) serving the tiny model and a LoRA adapter of it (engines/make_tiny_lora.py,
``--enable-lora --lora-modules tl=DIR``), KV events over ipc://, behind kvgate with a
``models`` table that lists the adapter (``lora_adapters``). For a chat and a completion
prompt sent to the engine directly under the adapter, the keys kvgate computes for it must all
enter its view from the engine's events alone (``lora_name`` "tl"), and the base model's keys
for the very same prompt must not: through kvgate, the adapter's request then hits its KV on
the engine, and the base model's finds none of it (the engine never reuses an adapter's KV for
the base model; its prefix-cache hit counter does not move). The emulator, serving the same
adapter, publishes the same events for the same request as the real engine.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from backends.engine_events import EngineBlockStored
from backends.kv_events import KVEventSubscriber
from config.loader import settings_from_dict
from gateway.app import build_app
from gateway.openai import CHAT, COMPLETIONS
from replay.emulator import EmulatorConfig, start_emulator
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

ADAPTERS = ("tl", "sql")
ADAPTER = ADAPTERS[0]
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def adapter_dirs(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The adapters of the tiny model (engines/make_tiny_lora.py), by name."""
    dirs = {}
    for name in ADAPTERS:
        adapter = tmp_path_factory.mktemp("lora") / name
        script = ENGINE_SCRIPTS / "make_tiny_lora.py"
        model = str(vllm_model_dir())
        cmd = [str(vllm_python()), str(script), "--model", model, "--out", str(adapter)]
        subprocess.run(cmd, check=True, timeout=300)
        dirs[name] = adapter
    return dirs


@pytest.fixture(scope="module")
def vllm_pair(
    adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[EngineProcess]]:
    """Two vLLMs serving the tiny model and two adapters of it, one adapter at a time each
    (``--max-loras 1``, vLLM's default), KV events over ipc://."""
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    # One adapter in a batch (vLLM's default); both kept loaded in host memory, so that a
    # switch costs no reload from disk.
    lora_args = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank"]
    lora_args += ["8", "--lora-modules"]
    ports = free_ports(2, 18300, 18350)

    def start(port: int) -> EngineProcess:
        sock = tmp_path_factory.mktemp("kv-events") / "vllm.sock"
        return start_vllm(
            port,
            kv_events_endpoint=f"ipc://{sock}",
            extra_args=[*lora_args, *modules, "--max-model-len", "2048"],
        )

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, p) for p in ports]
    procs = [f.result() for f in futures]  # a failed start raises here (the other is stopped)
    try:
        yield procs
    finally:
        for proc in procs:
            stop_engine(proc)


@pytest.fixture(scope="module")
def vllm_lora(vllm_pair: list[EngineProcess]) -> EngineProcess:
    return vllm_pair[0]


def _settings(engines: list[EngineProcess], affinity: bool = True) -> Any:
    engine = engines[0]
    instances = [
        {"id": f"v{i}", "url": e.url, "kv_events_endpoint": e.kv_events_endpoint}
        for i, e in enumerate(engines)
    ]
    return settings_from_dict(
        {
            "server": {"health_interval_s": 10.0, "refit_interval_s": 0, "scrape_interval_s": 0.5},
            "admission": {"mode": "none"},
            "replication": {"enabled": False},
            "routing": {"lora_affinity": affinity},
            "models": [
                {
                    "name": engine.model,
                    "pools": ["v"],
                    "model_dir": str(engine.model_dir),
                    "lora_adapters": list(ADAPTERS),
                }
            ],
            "pools": [{"name": "v", "role": "both", "instances": instances}],
        }
    )


def test_an_adapters_prompt_is_keyed_as_the_engine_keys_its_kv(vllm_lora: EngineProcess) -> None:
    system = "You answer questions about caches and their prefixes. " * 20
    requests = [
        (CHAT, {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "which engine holds it?"}]}),
        (COMPLETIONS, {"prompt": system + " and a text completion"}),
    ]  # fmt: skip
    app = build_app(_settings([vllm_lora]))
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


DOC = "A long shared document about caches, prefixes and the engines that hold them. " * 12


def _affinity_run(engines: list[EngineProcess], affinity: bool) -> dict[str, Any]:
    """Both adapters' KV of a shared document cached on v0 (sent to it directly), a long answer
    of the first adapter decoding there, then three requests of the second adapter on that
    document: where each went and its time to first token."""
    app = build_app(_settings(engines, affinity))
    gw = app.gateway
    tag = "on" if affinity else "off"

    def chat(adapter: str, question: str) -> dict[str, Any]:
        return {
            "model": adapter,
            "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": question}],
            "max_tokens": 64,
            "ignore_eos": True,
        }

    async def first_token(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
        """(instance, seconds to the first token, the open response to read on)."""
        t0 = time.monotonic()
        r = await s.post(url + "/v1/chat/completions", json={**body, "stream": True})
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            if b'"content"' in chunk:
                break
        return r.headers["x-kvgate-prefill"], time.monotonic() - t0, r

    async def main() -> dict[str, Any]:
        async with serving(app) as url, aiohttp.ClientSession() as s:
            # Each engine runs each adapter once (vLLM sets its LoRA gauge when it runs a
            # step, and an adapter's first use costs a load), and only v0 gets both adapters'
            # KV of the document.
            for engine, system in ((engines[1], "warm"), (engines[0], DOC)):
                for adapter in ADAPTERS:
                    body = {**chat(adapter, "warm"), "max_tokens": 1}
                    body["messages"][0]["content"] = system
                    async with s.post(engine.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
            slots = gw.conductor.lora.slots
            assert await wait_until(lambda: bool(slots("v0") and slots("v1"))), "no LoRA gauge"
            await asyncio.sleep(1.0)  # the KV events of the warm-ups
            # A long answer of one adapter decodes on v0 (its cached document brings it
            # there); then the other adapter's requests come, one after another.
            long = {**chat(ADAPTERS[0], f"go on at length ({tag})"), "max_tokens": 400}
            busy_on, _, busy = await first_token(s, url, long)
            out: dict[str, Any] = {"busy on": busy_on, "other adapter": []}
            for i in range(3):
                on, ttft, r = await first_token(s, url, chat(ADAPTERS[1], f"q{i} ({tag})?"))
                await r.read()
                out["other adapter"].append((on, round(ttft, 3)))
            busy.close()
        return out

    return asyncio.run(asyncio.wait_for(main(), timeout=240))


def test_an_adapter_goes_where_its_slot_is_free(vllm_pair: list[EngineProcess]) -> None:
    """Two engines that run one adapter at a time, both adapters' prefix cached on v0, where
    one adapter's long answer is decoding: the other adapter's requests go to v1 with affinity
    (on v0 they would wait for that answer to end, however cheap their cached prefill)."""
    without = _affinity_run(vllm_pair, affinity=False)
    with_ = _affinity_run(vllm_pair, affinity=True)
    print("\nLoRA affinity off:", without, "\nLoRA affinity on:", with_)
    assert with_["busy on"] == "v0"
    assert [on for on, _ in with_["other adapter"]] == ["v1"] * 3


def test_the_emulator_publishes_an_adapters_blocks_as_vllm_does(
    vllm_lora: EngineProcess, adapter_dirs: dict[str, Path]
) -> None:
    """The same chat request under the adapter, with a cache salt, sent to the real vLLM and
    to an emulator serving the same adapter (the model's tokenizer, vLLM's block size): the
    same BlockStored events (hashes, parent, tokens, lora_id, lora_name, extra keys)."""
    assert vllm_lora.kv_events_endpoint is not None and vllm_lora.model_dir is not None
    config = EmulatorConfig(
        time_scale=0.01,
        kv_events_port=0,
        kv_events_format="map",
        block_size=32,
        model=vllm_lora.model,
        model_dir=str(vllm_lora.model_dir),
        lora_adapters=tuple((name, str(path)) for name, path in adapter_dirs.items()),
    )
    system = f"An adapter's prompt, seen once ({uuid.uuid4().hex}). " * 12
    body = {
        "model": ADAPTER,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "cache_salt": "tenant-7",
    }

    async def main() -> dict[str, list[EngineBlockStored]]:
        emu = await start_emulator(config)
        seen: dict[str, list[EngineBlockStored]] = {"vllm": [], "emulator": []}

        def collect(name: str) -> Any:
            def on_events(_instance: str, events: list[Any]) -> None:
                stored = (e for e in events if isinstance(e, EngineBlockStored))
                seen[name].extend(e for e in stored if e.lora_name == ADAPTER)

            return on_events

        assert emu.kv_events_endpoint is not None
        subs = [
            KVEventSubscriber(vllm_lora.kv_events_endpoint, "vllm", collect("vllm")),
            KVEventSubscriber(emu.kv_events_endpoint, "emu", collect("emulator"), bind=False),
        ]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(sub.run(stop)) for sub in subs]
        try:
            await asyncio.sleep(0.5)  # ZMQ slow joiner: let both SUBs connect
            async with aiohttp.ClientSession() as s:
                for url in (vllm_lora.url, emu.url):
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
            await wait_until(lambda: bool(seen["vllm"] and seen["emulator"]))
            await asyncio.sleep(0.5)  # any later batch
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
            await emu.stop()
        return seen

    seen = asyncio.run(asyncio.wait_for(main(), timeout=120))

    def blocks(events: list[EngineBlockStored]) -> dict[str, Any]:
        """The events' blocks in order (vLLM may split a prompt's blocks over events)."""
        first = events[0]
        return {
            "hashes": [h for e in events for h in e.block_hashes],
            "parent": first.parent_block_hash,
            "tokens": [t for e in events for t in e.token_ids],
            "extra_keys": [k for e in events for k in (e.extra_keys or ())],
            "lora": {(e.lora_id, e.lora_name) for e in events},
        }

    real, ours = blocks(seen["vllm"]), blocks(seen["emulator"])
    print("\nadapter blocks, vLLM:", len(real["hashes"]), real["lora"], real["extra_keys"][:2])
    assert len(real["hashes"]) >= 10 and real["parent"] is None
    assert real["extra_keys"][:2] == [(ADAPTER, "tenant-7"), (ADAPTER,)]
    assert ours == real


async def _slot_wait(url: str) -> dict[str, Any]:
    """Adapter tl's long answer decoding on one engine, then a short request of adapter sql
    to the same engine: when its first token came against when tl's answer ended, and what
    /metrics said while it waited."""
    loop = asyncio.get_running_loop()

    def body(adapter: str, tokens: int) -> dict[str, Any]:
        prompt = f"{adapter} {uuid.uuid4().hex} " + DOC[:200]
        return {"model": adapter, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}

    async with aiohttp.ClientSession() as s:

        async def first_token_at() -> float:
            async with s.post(url + COMPLETIONS, json={**body("sql", 2), "stream": True}) as r:
                assert r.status == 200, await r.text()
                await r.content.readline()
                at = loop.time()
                await r.read()
                return at

        seen: dict[str, Any] = {}
        async with s.post(url + COMPLETIONS, json={**body("tl", 300), "stream": True}) as long:
            assert long.status == 200, await long.text()
            await long.content.readline()  # tl runs
            other = asyncio.create_task(first_token_at())
            sent = loop.time()
            await asyncio.sleep(0.3)
            async with s.get(url + "/metrics") as r:
                page = await r.text()
            series = re.findall(r"^(vllm:lora_requests_info\{[^}]*\}) (\S+)$", page, re.M)
            seen["series"] = max(series, key=lambda kv: float(kv[1]))[0] if series else None
            found = re.search(r'waiting_by_reason\{[^}]*reason="deferred"[^}]*\} (\S+)', page)
            seen["deferred"] = float(found.group(1)) if found else None
            await long.read()
            done = loop.time()
        first = await other
    seen["long after other sent s"] = round(done - sent, 3)
    seen["other first - long done s"] = round(first - done, 3)
    return seen


def test_a_second_adapter_waits_for_the_slot_as_on_vllm_and_the_emulator_says_so_alike(
    vllm_pair: list[EngineProcess], adapter_dirs: dict[str, Path]
) -> None:
    """vLLM --max-loras 1: a request for adapter sql sent while tl's long answer decodes waits
    for that answer to end (the engine is otherwise idle), ``num_requests_waiting_by_reason``
    counts it "deferred", and ``lora_requests_info`` lists only tl, in both labels (vLLM 0.32
    hears of a request's queueing with its first output, so a request waiting for a slot is
    not listed). The emulator, with the same adapters and one slot, does and says the same."""
    engine = vllm_pair[1]

    async def main() -> dict[str, dict[str, Any]]:
        real = await _slot_wait(engine.url)
        config = EmulatorConfig(
            time_scale=1.0,
            block_size=16,
            model=engine.model,
            lora_adapters=tuple((name, str(path)) for name, path in adapter_dirs.items()),
            max_loras=1,
        )
        emu = await start_emulator(config)
        try:
            emulated = await _slot_wait(emu.url)
        finally:
            await emu.stop()
        return {"vllm": real, "emulator": emulated}

    seen = asyncio.run(asyncio.wait_for(main(), timeout=180))
    print("\nanother adapter's request behind a one-slot engine:", seen)
    for name, s in seen.items():
        assert s["long after other sent s"] > 0.3, (name, s)  # it had something to wait for
        assert s["other first - long done s"] > -0.1, (name, s)  # and it did wait
        assert s["deferred"] == 1, (name, s)
        assert s["series"] is not None and 'running_lora_adapters="tl"' in s["series"]
        assert 'waiting_lora_adapters="tl"' in s["series"], (name, s)
