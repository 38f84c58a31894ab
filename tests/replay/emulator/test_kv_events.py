"""KV events over a real ZMQ SUB in both encodings, named by vLLM's own block hashes with the
token ids (as vLLM publishes them), the fetch endpoint, the event encoder."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator
from replay.emulator.kv_publisher import (
    StoredRun,
    VllmRemoved,
    VllmStored,
    encode_event,
    stored_runs,
    to_vllm,
)
from replay.emulator.vllm_hashing import (
    PLAIN,
    VllmBlockHashes,
    block_digest,
    external_hash,
    none_hash,
    stand_in_digest,
)
from routing.hashing import BlockHasher
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher(16)


def vllm_hashes(tokens: list[int], block_size: int = 16) -> list[int]:
    """vLLM's event hashes for a prompt's full blocks (vllm_hashing, pinned below)."""
    digest, out = none_hash(), []
    for end in range(block_size, len(tokens) + 1, block_size):
        digest = block_digest(digest, tokens[end - block_size : end])
        out.append(external_hash(digest))
    return out


def test_vllm_block_hashes_are_vllm_032s() -> None:
    # Computed with vLLM 0.32's own kv_cache_utils.hash_block_tokens (sha256, NONE_HASH from
    # "vllm-none-hash") and maybe_convert_block_hash, block size 32.
    assert none_hash().hex() == "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert vllm_hashes(list(range(64)), 32) == [13907755898995373680, 17701127471491950661]
    # A cache salt enters block 0's hash as a tagged extra key (events list it untagged).
    salted = block_digest(none_hash(), list(range(32)), (("cache_salt", "tenant-7"),))
    assert external_hash(salted) == 11298340755259597054


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
    v_long, v_other = vllm_hashes(longer), vllm_hashes(other)
    assert not set(v_long) & set(HASHER.hash_tokens(longer))  # never kvgate's own keys

    def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> Any:
        if fmt == "array":
            return ["BlockStored", hashes, parent, tokens, 16, None, "GPU"]
        return {  # vLLM 0.32's fields
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * len(hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": None,
            "locality": None,
            "ownership": None,
            "session_id": None,
        }

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        await complete(s, emu, first)
        topic, seq, events = await recv(sub)
        assert topic == b"kv-events" and seq == 0
        assert events == [stored(v_long[:6], None, first[:96])]
        await complete(s, emu, longer)
        _, seq, events = await recv(sub)
        assert seq == 1
        assert events == [stored(v_long[6:], v_long[5], longer[96:192])]
        # Capacity is 12 blocks: a new prompt evicts least-recently-used ones.
        await complete(s, emu, other)
        _, _, events = await recv(sub)
        removed = events[1]
        assert events[0] == stored(v_other, None, other[:96])
        if fmt == "array":
            assert removed[0] == "BlockRemoved" and removed[2] == "GPU"
            gone = removed[1]
        else:
            assert removed["type"] == "BlockRemoved" and removed["medium"] == "GPU"
            assert removed["group_idx"] == 0
            gone = removed["block_hashes"]
        assert gone == v_long[:6]
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
        # No tokens came with the copy: a stand-in name that no vLLM block has, no tokens.
        names = [external_hash(stand_in_digest(h)) for h in hashes[:12]]
        assert events == [["BlockStored", names, None, [], 16, None, "GPU"]]
        assert await complete(s, emu, prompt) == 12 * 16
        async with s.post(f"{emu.url}/internal/kv/fetch", json={"block_hashes": "x"}) as r:
            assert r.status == 400

    run_with_sub("array", body)


def test_a_copy_from_another_instance_carries_its_tokens_into_the_events() -> None:
    prompt = list(range(40, 40 + 160))  # 10 blocks
    hashes = HASHER.hash_tokens(prompt)

    async def body(emu: RunningEmulator, sub: zmq.asyncio.Socket, s: aiohttp.ClientSession) -> None:
        src = await start_emulator(EmulatorConfig(time_scale=0.01, kv_events_port=0))
        try:
            await complete(s, src, prompt)
            tokens_url = f"{src.url}/internal/kv/tokens"
            async with s.post(tokens_url, json={"block_hashes": [*hashes[:2], 99]}) as r:
                assert await r.json() == {"token_ids": None}  # 99: not a block it holds
            async with s.post(tokens_url, json={"block_hashes": "x"}) as r:
                assert r.status == 400
            fetch = {"source_url": src.url, "block_hashes": list(hashes[:8])}
            async with s.post(f"{emu.url}/internal/kv/fetch", json=fetch) as r:
                assert r.status == 200
            _, _, events = await recv(sub)
            # As if the destination had computed the blocks itself: vLLM's names, the tokens.
            stored = ["BlockStored", vllm_hashes(prompt)[:8], None, prompt[:128], 16, None, "GPU"]
            assert events == [stored]
        finally:
            await src.stop()

    run_with_sub("array", body)


def test_stored_runs_split_into_contiguous_runs() -> None:
    class Prompt:
        def __init__(self, hashes: tuple[int, ...], tokens: list[int] | None) -> None:
            self.block_hashes, self.token_ids, self.space = hashes, tokens, PLAIN

    a = Prompt((1, 2, 3, 4), list(range(8)))  # block size 2
    runs = stored_runs(BlockStored((2, 4, 99, 100)), [a], 2)
    assert runs == [
        StoredRun((2,), 1, (2, 3)),
        StoredRun((4,), 3, (6, 7)),
        StoredRun((99, 100), 4, ()),  # unknown blocks chain to the previous hash
    ]
    assert [r.start_block for r in runs[:2]] == [1, 3]
    assert encode_event(VllmRemoved((5,)), "map", 2) == {
        "type": "BlockRemoved",
        "block_hashes": [5],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert encode_event(AllBlocksCleared(), "array", 2) == ["AllBlocksCleared"]
    for raw in (BlockStored((1,)), BlockRemoved((1,))):  # emulator keys never go out as is
        with pytest.raises(TypeError):
            encode_event(raw, "array", 2)  # type: ignore[arg-type]


def test_to_vllm_rebuilds_a_forgotten_parent_from_the_prompt() -> None:
    tokens = list(range(6))  # block size 2: three blocks
    keys = (11, 12, 13)
    want = vllm_hashes(tokens, 2)

    class Prompt:
        block_hashes, token_ids, space = keys, tokens, PLAIN

    names = VllmBlockHashes(2)
    (run,) = stored_runs(BlockStored(keys[2:]), [Prompt()], 2)
    # The emulator never announced blocks 0 and 1 (e.g. its map was cleared since).
    assert to_vllm(run, names) == VllmStored((want[2],), want[1], (4, 5), start_block=2)
    assert names.get(13) is not None and names.get(12) is None
    assert external_hash(names.forget(13)) == want[2] and len(names) == 0
