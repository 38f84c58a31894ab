"""Prefill/decode hand-offs between two real emulators: vLLM NIXL-style and SGLang bootstrap."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from config.settings import PDProtocol, Role
from predictors.profiles import get_profile
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator
from replay.engine.timing import StepTiming

PROFILE = "llama2-70b-a100-tp8"
KV_BYTES = get_profile(PROFILE).kv_bytes_per_token
TIMING = StepTiming.from_profile(get_profile(PROFILE))
SCALE = 0.1
LINK_GBPS = 10.0
PROMPT = "word " * 800  # 1000 approximate tokens
TRANSFER_S = 1000 * KV_BYTES / (LINK_GBPS * 1e9 / 8)  # ~0.26 model seconds
NIXL_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

Body = Callable[[RunningEmulator, RunningEmulator, aiohttp.ClientSession], Awaitable[None]]


def run_pair(body: Body, protocol: PDProtocol, prefill: Any = None, decode: Any = None) -> None:
    async def main() -> None:
        common = {"profile": PROFILE, "time_scale": SCALE, "protocol": protocol}
        common["link_gbps"] = LINK_GBPS
        p = await start_emulator(EmulatorConfig(role=Role.PREFILL, **common, **(prefill or {})))
        d = await start_emulator(EmulatorConfig(role=Role.DECODE, **common, **(decode or {})))
        try:
            async with aiohttp.ClientSession() as session:
                await body(p, d, session)
        finally:
            await d.stop()
            await p.stop()

    asyncio.run(main())


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def prefill_leg(
    p: RunningEmulator, s: aiohttp.ClientSession, rid: str, prompt: str = PROMPT
) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": NIXL_REQUEST}
    async with s.post(f"{p.url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
    return out


def test_vllm_prefill_then_decode_pulls_the_pinned_kv() -> None:
    async def body(p: RunningEmulator, d: RunningEmulator, s: aiohttp.ClientSession) -> None:
        out = await prefill_leg(p, s, "req-1")
        params = out["kv_transfer_params"]
        assert params == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": params["remote_block_ids"],
            "remote_engine_id": p.config.engine_id,
            "remote_request_id": "req-1",
            "remote_host": "127.0.0.1",
            "remote_port": p.port,
            "tp_size": 1,
        }
        assert len(params["remote_block_ids"]) == 63  # ceil(1000 / 16)
        assert all(isinstance(b, int) for b in params["remote_block_ids"])
        assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["text"] == " tok0"
        assert len(p.state.pinned) == 1 and p.state.load().kv_usage > 0

        loop = asyncio.get_running_loop()
        decode_body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
        t0 = loop.time()
        async with s.post(
            f"{d.url}/v1/completions",
            json={**decode_body, "kv_transfer_params": params},
            headers={"X-Request-Id": "req-1"},
        ) as r:
            assert r.status == 200 and r.headers["X-Request-Id"] == "req-1"
            first = await r.content.readline()
            ttft = loop.time() - t0
            events = [json.loads(first.decode()[len("data: ") :]), *await read_sse(r)]
        # Really waited for the modelled transfer, then (as vLLM, which recomputes the last
        # prompt token) for a decode step that samples the first token itself.
        assert ttft >= (TRANSFER_S + TIMING.decode_steps(1, 1000, 1)) * SCALE * 0.99
        assert len(p.state.pinned) == 0  # the pull released the prefill's KV
        chunks = events[:-1]
        assert len(chunks) == 8 and events[-1] == "[DONE]"  # all max_tokens from decode steps
        assert d.state.engine.batch == 0 and d.state.runtime.inflight == 0

        # The KV was pulled: a second decode leg with the same params fails cleanly.
        async with s.post(
            f"{d.url}/v1/completions", json={**decode_body, "kv_transfer_params": params}
        ) as r:
            assert r.status == 502
            assert "no KV pinned" in (await r.json())["error"]["message"]

    run_pair(body, PDProtocol.VLLM)


# Long enough for the decode leg to reach the pinned KV on a busy 2-core box (0.1 s was not:
# the pin expired first and the decode answered 502), short enough to wait out in the test.
PIN_TIMEOUT_S = 0.5


def test_vllm_decode_refusal_pin_timeout_and_plain_requests() -> None:
    async def body(p: RunningEmulator, d: RunningEmulator, s: aiohttp.ClientSession) -> None:
        # Mooncake's decode-side check: the step time would break the TBT limit -> 503.
        params = (await prefill_leg(p, s, "a"))["kv_transfer_params"]
        payload = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}
        async with s.post(f"{d.url}/v1/completions", json=payload) as r:
            assert r.status == 503
            err = (await r.json())["error"]
            assert err["type"] == "ServiceUnavailableError" and "step time" in err["message"]
        assert len(p.state.pinned) == 0
        # KV nobody pulls is freed after the abort timeout.
        await prefill_leg(p, s, "b")
        assert len(p.state.pinned) == 1
        await asyncio.sleep(PIN_TIMEOUT_S * 2)
        assert len(p.state.pinned) == 0
        # A plain request on a decode instance is served colocated (as vLLM does).
        async with s.post(f"{d.url}/v1/completions", json={"prompt": "hi " * 50}) as r:
            assert r.status == 200
            assert (await r.json())["usage"]["completion_tokens"] == 16

    run_pair(
        body,
        PDProtocol.VLLM,
        prefill={"pin_timeout_s": PIN_TIMEOUT_S},
        decode={"decode_tbt_limit_ms": 1},
    )


def test_sglang_bootstrap_legs_run_concurrently() -> None:
    async def body(p: RunningEmulator, d: RunningEmulator, s: aiohttp.ClientSession) -> None:
        assert p.bootstrap_port is not None and p.bootstrap_port != p.port
        loop = asyncio.get_running_loop()

        async def leg(url: str, room: int, delay: float) -> tuple[list[Any], float]:
            await asyncio.sleep(delay)
            body = {
                "prompt": PROMPT,
                "max_tokens": 5,
                "stream": True,
                "stream_options": {"include_usage": True},
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": p.bootstrap_port,
                "bootstrap_room": room,
            }
            async with s.post(f"{url}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                first = await r.content.readline()
                t_first = loop.time()
                return [json.loads(first.decode()[len("data: ") :]), *await read_sse(r)], t_first

        cached = []
        for _ in range(2):
            room = random.randint(0, 2**63 - 1)
            t0 = loop.time()
            # The decode leg asks first: it must wait for the prefill's room.
            (d_events, d_first), (p_events, p_first) = await asyncio.gather(
                leg(d.url, room, 0.0), leg(p.url, room, 0.02)
            )
            assert len(p_events) == 3  # prefill: one token, usage, [DONE]
            assert p_events[1]["usage"]["completion_tokens"] == 1
            assert [e for e in d_events[:-2]][-1]["choices"][0]["finish_reason"] == "length"
            assert len(d_events) == 5 + 2
            usage = d_events[-2]["usage"]
            assert usage["completion_tokens"] == 5
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            assert d_first - t0 >= 0.02 + TRANSFER_S * SCALE * 0.99
            assert d_first >= p_first
        assert cached == [0, 992]  # the decode reports the prefill's prefix-cache hit
        assert p.state.rooms.pinned_tokens == 0 and p.state.load().kv_usage == 0

        # No prefill ever registers the room: the decode gives up with 504.
        body = {"prompt": "x" * 64, "bootstrap_host": "127.0.0.1", "bootstrap_room": 7}
        async with s.post(f"{d.url}/v1/completions", json={**body, "bootstrap_port": p.port}) as r:
            assert r.status == 504

    run_pair(
        body, PDProtocol.SGLANG, prefill={"bootstrap_port": 0}, decode={"bootstrap_timeout_s": 0.2}
    )
