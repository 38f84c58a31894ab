"""LoRA adapters and cache salts in the emulator, as vLLM 0.32 serves them: a request naming an
adapter (or carrying a salt) is keyed and published in its own space (vLLM's hashes with the
tagged extra keys, the events' ``lora_id`` / ``lora_name`` / untagged ``extra_keys``), an
unknown model is a 404, ``/v1/models`` lists the adapters, ``--max-loras`` adapters run at
once and ``vllm:lora_requests_info`` lists them as vLLM 0.32 does, a copied prefix keeps its
space; and a gateway told of the adapter learns its blocks from the events alone."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
import zmq.asyncio

from config.settings import Settings
from gateway.openai import COMPLETIONS
from gateway.stack import StackSpec
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator
from replay.emulator.vllm_hashing import (
    PLAIN,
    BlockNamespace,
    VllmBlockHashes,
    block_digest,
    external_hash,
    none_hash,
)
from routing.hashing import BlockHasher
from tests.gateway.live import live_stack
from tests.replay.emulator.test_kv_events import recv, run_with_sub

ADAPTER = BlockNamespace("tl", "/adapters/tl", 1)


def test_adapter_and_salt_hashes_are_vllm_032s() -> None:
    # Computed with vLLM 0.32's own kv_cache_utils (hash_block_tokens with
    # generate_block_hash_extra_keys' tagged keys, maybe_convert_block_hash), block size 32.
    lora = ADAPTER.hash_keys(0)
    assert lora == (("lora", "tl", "/adapters/tl"),) and ADAPTER.hash_keys(5) == lora
    h0 = block_digest(none_hash(), list(range(32)), lora)
    h1 = block_digest(h0, list(range(32, 64)), ADAPTER.hash_keys(1))
    assert [external_hash(h0), external_hash(h1)] == [17251163153420395987, 8919554377252686343]
    salted = replace(ADAPTER, cache_salt="tenant-7")
    assert external_hash(block_digest(none_hash(), list(range(32)), salted.hash_keys(0))) == (
        17314083860881961311
    )
    # Events carry them untagged (to_event_extra_keys): the name, and the salt on block 0.
    assert [salted.event_keys(0), salted.event_keys(1)] == [["tl", "tenant-7"], ["tl"]]
    assert PLAIN.hash_keys(0) is None and PLAIN.event_keys(0) is None
    # The chain keeps the space: a forgotten parent is rebuilt in it.
    names = VllmBlockHashes(32)
    _, digests = names.chain((1, 2), list(range(64)), None, space=ADAPTER)
    assert digests == [h0, h1] and names.space_of([1, 2]) == ADAPTER
    assert names.space_of([1, 99]) is None  # 99: a plain block (not held, but not one space)
    fresh = VllmBlockHashes(32)
    parent, (again,) = fresh.chain((2,), list(range(32, 64)), 1, list(range(64)), 1, ADAPTER)
    assert parent == h0 and again == h1


def adapter_config(**cfg: Any) -> dict[str, Any]:
    return {"block_size": 32, "lora_adapters": (("tl", "/adapters/tl"),), **cfg}


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_an_adapters_blocks_are_published_as_vllm_publishes_them(fmt: str) -> None:
    prompt = list(range(70))  # two full 32-token blocks

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        req = {"model": "tl", "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-7"}
        async with s.post(f"{emu.url}/v1/completions", json=req) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["model"] == "tl"
        _, _, (event,) = await recv(sub)
        if fmt == "array":  # the fields after medium, in vLLM's struct order
            keys = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
            keys += ["lora_id", "medium", "lora_name", "extra_keys"]
            event = dict(zip(keys, event, strict=True))
        assert event["block_hashes"] == [17314083860881961311, _second_salted_block()]
        assert event["token_ids"] == prompt[:64] and event["parent_block_hash"] is None
        assert (event["lora_id"], event["lora_name"]) == (1, "tl")
        assert event["extra_keys"] == [["tl", "tenant-7"], ["tl"]]

    run_with_sub(fmt, body, **adapter_config())


def _second_salted_block() -> int:
    salted = replace(ADAPTER, cache_salt="tenant-7")
    h0 = block_digest(none_hash(), list(range(32)), salted.hash_keys(0))
    return external_hash(block_digest(h0, list(range(32, 64)), salted.hash_keys(1)))


def test_models_lists_adapters_and_an_unknown_model_is_a_404() -> None:
    async def main() -> None:
        config = EmulatorConfig(time_scale=0.01, model="base", **adapter_config())
        emu = await start_emulator(config)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{emu.url}/v1/models") as r:
                    cards = (await r.json())["data"]
                assert [(c["id"], c["parent"], c["root"]) for c in cards[1:]] == [
                    ("tl", "base", "/adapters/tl")
                ]
                assert cards[0]["id"] == "base" and cards[0]["parent"] is None
                # The same prompt under the adapter does not hit the base model's KV.
                prompt = {"prompt": list(range(100)), "max_tokens": 1}
                cached = []
                for model in ("base", "tl", None, "tl"):
                    req = prompt if model is None else {**prompt, "model": model}
                    async with s.post(f"{emu.url}/v1/completions", json=req) as r:
                        assert r.status == 200, await r.text()
                        cached.append((await r.json())["usage"]["prompt_tokens_details"])
                assert [c["cached_tokens"] for c in cached] == [0, 0, 96, 96]
                req = {**prompt, "model": "nope"}
                async with s.post(f"{emu.url}/v1/completions", json=req) as r:
                    assert r.status == 404
                    assert (await r.json())["error"] == {
                        "message": "The model `nope` does not exist.",
                        "type": "NotFoundError",
                        "param": "model",
                        "code": 404,
                    }
        finally:
            await emu.stop()

    asyncio.run(main())


def test_lora_requests_info_names_the_running_adapter() -> None:
    async def main() -> list[str]:
        emu = await start_emulator(EmulatorConfig(time_scale=1.0, **adapter_config()))
        try:
            async with aiohttp.ClientSession() as s:
                req = {"model": "tl", "prompt": [1] * 64, "max_tokens": 2000, "stream": True}
                async with s.post(f"{emu.url}/v1/completions", json=req) as r:
                    assert r.status == 200
                    await r.content.readline()  # the first token: it runs
                    running = await _lora_series(s, emu)
                await asyncio.sleep(0.3)  # the client left: the engine dropped it
                return [running, await _lora_series(s, emu)]
        finally:
            await emu.stop()

    running, after = asyncio.run(main())
    assert 'max_lora="1"' in running and 'running_lora_adapters="tl"' in running
    assert 'running_lora_adapters=""' in after  # the newest series: nothing runs


@pytest.mark.parametrize("max_loras", [1, 2])
def test_another_adapter_waits_for_a_slot_as_in_vllm(max_loras: int) -> None:
    """vLLM's --max-loras: with one slot, a request for adapter t2 waits while tl's long answer
    decodes, however idle the engine, and /metrics shows it as vLLM 0.32 does (one request
    "deferred"; lora_requests_info lists only tl, in both labels: vLLM hears of a request with
    its first output); with two slots it runs at once."""
    adapters = (("tl", "/adapters/tl"), ("t2", "/adapters/t2"))

    async def main() -> dict[str, Any]:
        config = EmulatorConfig(
            time_scale=0.2, block_size=32, lora_adapters=adapters, max_loras=max_loras
        )
        emu = await start_emulator(config)
        loop = asyncio.get_running_loop()
        url = f"{emu.url}/v1/completions"
        try:
            async with aiohttp.ClientSession() as s:

                async def first_token_at() -> float:
                    req = {"model": "t2", "prompt": [2] * 64, "max_tokens": 2, "stream": True}
                    async with s.post(url, json=req) as r:
                        assert r.status == 200, await r.text()
                        await r.content.readline()
                        at = loop.time()
                        await r.read()
                        return at

                req = {"model": "tl", "prompt": [1] * 64, "max_tokens": 300, "stream": True}
                async with s.post(url, json=req) as long:
                    assert long.status == 200
                    await long.content.readline()  # tl runs
                    other = asyncio.create_task(first_token_at())
                    await asyncio.sleep(0.1)
                    seen = {"series": await _lora_series(s, emu)}
                    async with s.get(f"{emu.url}/metrics") as r:
                        page = await r.text()
                    found = re.search(r'reason="deferred"\} (\S+)', page)
                    seen["deferred"] = float(found.group(1)) if found else None
                    await long.read()
                    seen["long done"] = loop.time()
                seen["other first"] = await other
                return seen
        finally:
            await emu.stop()

    seen = asyncio.run(main())
    if max_loras == 1:
        assert seen["other first"] >= seen["long done"] - 0.02, seen
        assert 'running_lora_adapters="tl"' in seen["series"], seen
        assert 'waiting_lora_adapters="tl"' in seen["series"] and seen["deferred"] == 1
    else:
        assert seen["other first"] < seen["long done"] - 0.1, seen
        assert seen["deferred"] == 0, seen


def test_an_adapter_not_in_host_memory_is_read_in_first() -> None:
    """--max-cpu-loras 1 --lora-load-s 0.3: the first request of tl and the one of t2 after it
    wait for the load; tl's second request, still in host memory, does not."""
    adapters = (("tl", "/adapters/tl"), ("t2", "/adapters/t2"))

    async def main() -> list[float]:
        config = EmulatorConfig(
            time_scale=1.0, block_size=32, lora_adapters=adapters, max_cpu_loras=1, lora_load_s=0.3
        )
        emu = await start_emulator(config)
        loop = asyncio.get_running_loop()
        ttfts = []
        try:
            async with aiohttp.ClientSession() as s:
                for i, model in enumerate(("tl", "tl", "t2")):
                    req = {"model": model, "prompt": [i] * 40, "max_tokens": 1}
                    t0 = loop.time()
                    async with s.post(f"{emu.url}/v1/completions", json=req) as r:
                        assert r.status == 200, await r.text()
                    ttfts.append(loop.time() - t0)
        finally:
            await emu.stop()
        return ttfts

    first, again, other = asyncio.run(main())
    assert first >= 0.3 and other >= 0.3 and again < 0.2, (first, again, other)


async def _lora_series(s: aiohttp.ClientSession, emu: RunningEmulator) -> str:
    """The newest ``vllm:lora_requests_info`` series (the one with the latest time)."""
    async with s.get(f"{emu.url}/metrics") as r:
        text = await r.text()
    series = re.findall(r"^(vllm:lora_requests_info\{[^}]*\}) (\S+)$", text, re.M)
    assert series, text
    return max(series, key=lambda kv: float(kv[1]))[0]


def test_a_gateway_told_of_the_adapter_learns_its_blocks_from_the_events() -> None:
    settings = Settings()
    settings = replace(settings, routing=replace(settings.routing, lora_adapters=("tl",)))
    spec = StackSpec(colocated=2, time_scale=0.01, base=settings)
    with live_stack(spec) as stack:
        gw = stack.gateway
        body = {"prompt": "An adapter's long shared document about caches. " * 40}

        def keys(model: str | None) -> tuple[int, ...]:
            raw = json.dumps({**body, "model": model}).encode()
            return gw.parse_prompt(COMPLETIONS, gw.parse_head(raw), {}, "p").info.block_hashes

        adapter, base = keys("tl"), keys(None)
        emu = stack.stack.emulators["c1"]

        async def direct() -> None:  # not through kvgate: only the events can tell it
            async with aiohttp.ClientSession() as s:
                req = {**body, "model": "tl", "max_tokens": 1}
                async with s.post(f"{emu.url}/v1/completions", json=req) as r:
                    assert r.status == 200, await r.text()
            for _ in range(100):
                if all(gw.conductor.index.holds("c1", k) for k in adapter):
                    return
                await asyncio.sleep(0.05)

        stack.run(direct())
        held = stack.call(lambda: sum(gw.conductor.index.holds("c1", k) for k in adapter))
        base_held = stack.call(lambda: sum(gw.conductor.index.holds("c1", k) for k in base))
        assert len(adapter) > 20 and held == len(adapter)
        assert base_held == 0 and not set(adapter) & set(base)


def test_a_copied_adapter_prefix_keeps_its_space_in_the_events() -> None:
    prompt = list(range(64))  # two 32-token blocks
    hasher = BlockHasher(32)
    keys = hasher.hash_tokens(prompt, hasher.namespace_root("tl", None))
    h0 = block_digest(none_hash(), prompt[:32], ADAPTER.hash_keys(0))
    h1 = block_digest(h0, prompt[32:], ADAPTER.hash_keys(1))

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        config = EmulatorConfig(time_scale=0.01, kv_events_port=0, **adapter_config())
        src = await start_emulator(config)  # its events book knows the tokens
        try:
            req = {"model": "tl", "prompt": prompt, "max_tokens": 1}
            async with s.post(f"{src.url}/v1/completions", json=req) as r:
                assert r.status == 200
            fetch = {"source_url": src.url, "block_hashes": list(keys)}
            async with s.post(f"{emu.url}/internal/kv/fetch", json=fetch) as r:
                assert r.status == 200
            _, _, (event,) = await recv(sub)
        finally:
            await src.stop()
        # As if the destination had run the adapter's request itself.
        assert event["block_hashes"] == [external_hash(h0), external_hash(h1)]
        assert (event["lora_id"], event["lora_name"]) == (1, "tl")
        assert event["extra_keys"] == [["tl"], ["tl"]] and event["token_ids"] == prompt

    run_with_sub("map", body, **adapter_config())
