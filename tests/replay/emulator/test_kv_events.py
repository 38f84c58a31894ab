"""KV events over a real ZMQ SUB in both encodings, the fetch endpoint, the event encoder."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator
from replay.emulator.kv_publisher import StoredRun, encode_event, stored_runs
from routing.hashing import BlockHasher
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher(16)


async def recv(sub: zmq.asyncio.Socket) -> tuple[bytes, int, list[Any]]:
    topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 2)
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0
    return topic, int.from_bytes(seq, "big"), events


async def complete(s: aiohttp.ClientSession, emu: RunningEmulator, prompt: list[int]) -> int:
    async with s.post(f"{emu.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200
        cached: int = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached


def run_with_sub(fmt: str, body: Any, **cfg: Any) -> None:
    async def main() -> None:
        config = EmulatorConfig(time_scale=0.01, kv_events_port=0, kv_events_format=fmt, **cfg)  # type: ignore[arg-type]
        emu = await start_emulator(config)
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        assert emu.kv_events_endpoint is not None
        sub.connect(emu.kv_events_endpoint)
        await asyncio.sleep(0.2)  # ZMQ slow joiner: let the subscription reach the PUB
        try:
            async with aiohttp.ClientSession() as session:
                await body(emu, sub, session)
        finally:
            sub.close()
            ctx.term()
            await emu.stop()

    asyncio.run(main())


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_kv_events_follow_the_prefix_cache(fmt: str) -> None:
    first = list(range(100))  # 6 full blocks
    longer = first + list(range(500, 600))  # 12 full blocks, sharing the first 6
    other = list(range(1000, 1100))
    h_long = HASHER.hash_tokens(longer)

    def stored(hashes: tuple[int, ...], parent: int | None, tokens: list[int]) -> Any:
        if fmt == "array":
            return ["BlockStored", list(hashes), parent, tokens, 16, None, "GPU"]
        return {
            "type": "BlockStored",
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        }

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        await complete(s, emu, first)
        topic, seq, events = await recv(sub)
        assert topic == b"kv-events" and seq == 0
        assert events == [stored(h_long[:6], None, first[:96])]
        await complete(s, emu, longer)
        _, seq, events = await recv(sub)
        assert seq == 1
        assert events == [stored(h_long[6:], h_long[5], longer[96:192])]
        # Capacity is 12 blocks: a new prompt evicts least-recently-used ones.
        await complete(s, emu, other)
        _, _, events = await recv(sub)
        removed = events[1]
        assert events[0] == stored(HASHER.hash_tokens(other), None, other[:96])
        if fmt == "array":
            assert removed[0] == "BlockRemoved" and removed[2] == "GPU"
            gone = removed[1]
        else:
            assert removed["type"] == "BlockRemoved" and removed["medium"] == "GPU"
            gone = removed["block_hashes"]
        assert gone == list(h_long[:6])
        async with s.post(f"{emu.url}/reset_prefix_cache") as r:
            assert r.status == 200
        _, seq, events = await recv(sub)
        assert seq == 3
        assert events == (
            [["AllBlocksCleared"]] if fmt == "array" else [{"type": "AllBlocksCleared"}]
        )
        assert await complete(s, emu, first) == 0

    run_with_sub(fmt, body, cache_capacity_tokens=12 * 16)


def test_fetch_inserts_blocks_that_later_requests_hit() -> None:
    prompt = list(range(7, 7 + 320))  # 20 blocks
    hashes = HASHER.hash_tokens(prompt)

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        fetch = {"source_url": "http://127.0.0.1:9", "block_hashes": list(hashes[:12])}
        async with s.post(f"{emu.url}/internal/kv/fetch", json={**fetch, "tokens": 192}) as r:
            assert r.status == 200
            assert await r.json() == {"ok": True, "blocks": 12}
        _, _, events = await recv(sub)
        assert events == [["BlockStored", list(hashes[:12]), None, [], 16, None, "GPU"]]
        assert await complete(s, emu, prompt) == 12 * 16
        async with s.post(f"{emu.url}/internal/kv/fetch", json={"block_hashes": "x"}) as r:
            assert r.status == 400

    run_with_sub("array", body)


def test_stored_runs_split_into_contiguous_runs() -> None:
    class Prompt:
        def __init__(self, hashes: tuple[int, ...], tokens: list[int] | None) -> None:
            self.block_hashes, self.token_ids = hashes, tokens

    a = Prompt((1, 2, 3, 4), list(range(8)))  # block size 2
    runs = stored_runs(BlockStored((2, 4, 99, 100)), [a], 2)
    assert runs == [
        StoredRun((2,), 1, (2, 3)),
        StoredRun((4,), 3, (6, 7)),
        StoredRun((99, 100), 4, ()),  # unknown blocks chain to the previous hash
    ]
    assert encode_event(BlockRemoved((5,)), "map", 2) == {
        "type": "BlockRemoved",
        "block_hashes": [5],
        "medium": "GPU",
    }
    assert encode_event(AllBlocksCleared(), "array", 2) == ["AllBlocksCleared"]
    with pytest.raises(TypeError):
        encode_event(BlockStored((1,)), "array", 2)
