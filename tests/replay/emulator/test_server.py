"""The emulator as an OpenAI server: shapes, streaming, timing, caching, errors, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from config.settings import PDProtocol
from predictors.profiles import get_profile
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator
from replay.engine.timing import StepTiming

PROFILE = "llama2-70b-a100-tp8"  # ~14 ms decode steps: model time dominates loop overhead
TIMING = StepTiming.from_profile(get_profile(PROFILE))
SCALE = 0.1
PROMPT = "word " * 800  # 4000 characters = 1000 approximate tokens


def run(
    body: Callable[[RunningEmulator, aiohttp.ClientSession], Awaitable[None]], **cfg: Any
) -> None:
    async def main() -> None:
        config = EmulatorConfig(**{"profile": PROFILE, "time_scale": SCALE, **cfg})
        emu = await start_emulator(config)
        try:
            async with aiohttp.ClientSession() as session:
                await body(emu, session)
        finally:
            await emu.stop()

    asyncio.run(main())


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_non_streaming_shape_and_timing() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        payload = {"prompt": PROMPT, "max_tokens": 10}
        async with s.post(
            f"{emu.url}/v1/completions", json=payload, headers={"X-Request-Id": "r1"}
        ) as r:
            assert r.status == 200
            assert r.headers["X-Request-Id"] == "r1"
            out = await r.json()
        elapsed = loop.time() - t0
        assert out["id"] == "cmpl-r1" and out["object"] == "text_completion"
        assert out["model"] == PROFILE and isinstance(out["created"], int)
        (choice,) = out["choices"]
        assert choice["text"].split() == [f"tok{i}" for i in range(10)]
        assert choice["finish_reason"] == "length"
        assert out["usage"] == {
            "prompt_tokens": 1000,
            "completion_tokens": 10,
            "total_tokens": 1010,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        assert out["kv_transfer_params"] is None
        modeled = TIMING.prefill(1000, 0) + TIMING.decode_steps(1, 1001, 9)
        assert modeled * SCALE * 0.99 <= elapsed < modeled * SCALE * 3 + 0.2

    run(body)


def test_streaming_completion_one_chunk_per_token_with_usage() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        loop = asyncio.get_running_loop()
        payload = {
            "prompt": PROMPT,
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = loop.time()
        async with s.post(f"{emu.url}/v1/completions", json=payload) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first = await r.content.readline()
            ttft = loop.time() - t0
            rest = await read_sse(r)
        events = [json.loads(first.decode()[len("data: ") :]), *rest]
        assert ttft >= TIMING.prefill(1000, 0) * SCALE * 0.99
        assert events[-1] == "[DONE]"
        tokens, usage = events[:-2], events[-2]
        assert [e["choices"][0]["text"] for e in tokens] == [f" tok{i}" for i in range(6)]
        assert [e["choices"][0]["finish_reason"] for e in tokens] == [None] * 5 + ["length"]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6

    run(body)


def test_chat_completions_streaming_and_not() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        messages = [
            {"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": [{"type": "text", "text": "hi there " * 30}]},
        ]
        payload = {"model": "x", "messages": messages, "max_completion_tokens": 3}
        async with s.post(f"{emu.url}/v1/chat/completions", json=payload) as r:
            out = await r.json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["model"] == "x"  # echoes the request's model name, like vLLM
        msg = out["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": " tok0 tok1 tok2"}
        assert out["usage"]["completion_tokens"] == 3
        prompt_tokens = out["usage"]["prompt_tokens"]
        async with s.post(
            f"{emu.url}/v1/chat/completions", json={**payload, "stream": True, "max_tokens": 9}
        ) as r:
            events = await read_sse(r)
        chunks = events[:-1]
        assert events[-1] == "[DONE]" and len(chunks) == 3  # max_completion_tokens wins
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": " tok0"}
        assert chunks[2]["choices"][0]["finish_reason"] == "length"
        # The same conversation again: its prefix is cached.
        async with s.post(f"{emu.url}/v1/chat/completions", json=payload) as r:
            again = await r.json()
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == min(prompt_tokens // 16 * 16, prompt_tokens - 1) > 0

    run(body, model="x")


def test_token_id_prompts_hit_the_prefix_cache() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        prompt = list(range(1000, 1500))  # 500 tokens = 31 full blocks
        cached = []
        for extra in ([], list(range(7, 107))):
            payload = {"prompt": prompt + extra, "max_tokens": 2}
            async with s.post(f"{emu.url}/v1/completions", json=payload) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached == [0, 31 * 16]

    run(body)


def test_bad_requests_get_openai_errors() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        url = f"{emu.url}/v1/completions"
        async with s.post(url, data=b"{not json", headers={"X-Request-Id": "bad"}) as r:
            assert r.status == 400 and r.headers["X-Request-Id"] == "bad"
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
        cases = [
            ({"max_tokens": 3}, "prompt"),
            ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
            ({"prompt": [1, "a"]}, "prompt"),
            ({"prompt": ""}, "prompt"),
            ({"prompt": "hi", "n": 2}, "n"),
            ({"prompt": "hi", "stream": "yes"}, "stream"),
            ({"prompt": [1] * 10, "max_tokens": 10_000_000}, "max_tokens"),
        ]
        for payload, param in cases:
            async with s.post(url, json=payload) as r:
                assert r.status == 400, payload
                assert (await r.json())["error"]["param"] == param
        async with s.post(f"{emu.url}/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 400
        async with s.post(url, json=[1, 2]) as r:
            assert r.status == 400

    run(body)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_models_health_and_metrics() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        async with s.get(f"{emu.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{emu.url}/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list" and models["data"][0]["id"] == "served"
        for _ in range(2):
            async with s.post(f"{emu.url}/v1/completions", json={"prompt": PROMPT}) as r:
                assert r.status == 200
        async with s.get(f"{emu.url}/metrics") as r:
            text = await r.text()
        m = _samples(text)
        base = (("engine", "0"), ("model_name", "served"))
        assert m[("vllm:num_requests_running", base)] == 0
        assert m[("vllm:num_requests_waiting", base)] == 0
        assert m[("vllm:kv_cache_usage_perc", base)] == 0
        assert m[("vllm:prefix_cache_queries_total", base)] == 2000
        assert m[("vllm:prefix_cache_hits_total", base)] == 992  # 62 blocks of the repeat
        assert m[("vllm:time_to_first_token_seconds_count", base)] == 2
        assert m[("vllm:inter_token_latency_seconds_count", base)] == 2 * 15
        assert (
            m[("vllm:request_success_total", tuple(sorted((*base, ("finished_reason", "length")))))]
            == 2
        )
        info = [k for k in m if k[0] == "vllm:cache_config_info"]
        assert dict(info[0][1])["block_size"] == "16"
        assert int(dict(info[0][1])["num_gpu_blocks"]) == 1349914 // 16
        assert m[("sglang:cache_hit_rate", (("model_name", "served"),))] == 992 / 2000
        assert ("sglang:num_running_reqs", (("model_name", "served"),)) in m

    run(body, model="served", protocol=PDProtocol.SGLANG)


def test_client_disconnect_drops_the_request() -> None:
    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        payload = {"prompt": PROMPT, "max_tokens": 5000, "stream": True}
        r = await s.post(f"{emu.url}/v1/completions", json=payload)
        for _ in range(3 * 2):  # three chunks (data line + blank line each)
            await r.content.readline()
        assert emu.state.runtime.inflight == 1 and emu.state.engine.batch == 1
        r.close()  # drop the connection mid-stream
        for _ in range(200):
            if emu.state.runtime.inflight == 0:
                break
            await asyncio.sleep(0.01)
        async with s.get(f"{emu.url}/internal/state") as resp:
            state = await resp.json()
        assert state["running"] == 0 and state["inflight"] == 0
        assert not emu.state.engine.running and not emu.state.engine.joining
        async with s.get(f"{emu.url}/metrics") as resp:
            m = _samples(await resp.text())
        key = (("engine", "0"), ("finished_reason", "abort"), ("model_name", PROFILE))
        assert m[("vllm:request_success_total", key)] == 1

    run(body)
