"""KV event decoding (both vLLM encodings), encoding round trips, and the ZMQ subscriber
against a real PUB (and replay ROUTER) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from backends.kv_events import (
    KVEventBatch,
    KVEventDecodeError,
    KVEventSubscriber,
    decode_batch,
    encode_batch,
)
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

DATA = Path(__file__).parent / "data"
MASK = (1 << 64) - 1
T = TypeVar("T")


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=15))


def _u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & MASK


# --- captured-style fixtures (tests/backends/data/vllm_kv_events_*.msgpack) ----------------
#
# vllm_kv_events_array.msgpack -- vLLM <= 0.2x, events as arrays, tag first:
# [1750000000.125, [
#   ["BlockStored", [1001, 1002], null, [0, ..., 31], 16, null, "GPU"],
#   ["BlockStored", [1003], 1002, [32, ..., 47], 16, null, "CPU",
#                   null, [null], 0, "full_attention", null],   <- lora_name, extra_keys,
#                                                                  group_idx, spec kind/window
#   ["BlockRemoved", [1001], "GPU"],
#   ["BlockRemoved", [1003], "CPU", 0],                          <- group_idx
#   ["AllBlocksCleared"]
# ], 0]
#
# vllm_kv_events_map.msgpack -- after vLLM PR #42892, events as maps, outer batch an array:
# [1750000001.5, [
#   {"type": "BlockStored", "block_hashes": [2001, 2002], "parent_block_hash": null,
#    "token_ids": [100, ..., 131], "block_size": 16, "lora_id": null, "medium": "GPU",
#    "lora_name": null, "extra_keys": [null], "group_idx": 0,
#    "kv_cache_spec_kind": "full_attention"},
#   {"type": "BlockRemoved", "block_hashes": [2001], "medium": "GPU", "group_idx": 0},
#   {"type": "AllBlocksCleared"}
# ], 1]
#
# vllm_kv_events_bytes_hashes.msgpack -- oldest shape: no medium, sha256 bytes hashes
# (bin 32), dp_rank omitted by omit_defaults:
# [1750000002.0, [
#   ["BlockStored", [<sha256("block-0")>, <sha256("block-1")>], null, [0, ..., 31], 16, null],
#   ["BlockStored", [<sha256("block-2")>], <sha256("block-1")>, [32, ..., 47], 16, null],
#   ["BlockRemoved", [<sha256("block-0")>]]
# ]]
SHA = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(3)]


def _read(name: str) -> bytes:
    return (DATA / f"vllm_kv_events_{name}.msgpack").read_bytes()


def test_fixture_array_encoding() -> None:
    raw = msgpack.unpackb(_read("array"))
    assert raw[1][1][7:] == [None, [None], 0, "full_attention", None]  # trailing fields exist
    assert decode_batch(_read("array")) == KVEventBatch(
        ts=1750000000.125,
        events=[
            BlockStored((1001, 1002), Tier.GPU),
            BlockStored((1003,), Tier.HOST),
            BlockRemoved((1001,), Tier.GPU),
            BlockRemoved((1003,), Tier.HOST),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )


def test_fixture_map_encoding() -> None:
    assert decode_batch(_read("map")) == KVEventBatch(
        ts=1750000001.5,
        events=[BlockStored((2001, 2002)), BlockRemoved((2001,)), AllBlocksCleared()],
        dp_rank=1,
    )


def test_fixture_bytes_hashes_and_missing_medium_and_rank() -> None:
    batch = decode_batch(_read("bytes_hashes"))
    h = [_u64(d) for d in SHA]
    assert h[0] == int.from_bytes(SHA[0][-8:], "big")  # the low 64 bits of the digest
    assert batch == KVEventBatch(
        ts=1750000002.0,
        events=[BlockStored((h[0], h[1])), BlockStored((h[2],)), BlockRemoved((h[0],))],
        dp_rank=None,
    )


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_int_hashes_are_masked_to_64_bits() -> None:
    # Some publishers write the u64 hash as a signed i64; masking makes both readings agree.
    batch = decode_batch(_pack([0.0, [["BlockRemoved", [-1, -(1 << 63), 5], "GPU"]], 0]))
    assert batch.events == [BlockRemoved((MASK, 1 << 63, 5))]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("CPU", Tier.HOST),
        ("cpu", Tier.HOST),
        ("DISK", Tier.STORE),
        ("disk", Tier.STORE),
        ("LMCache", Tier.STORE),
    ],
)
def test_medium_to_tier(medium: str | None, tier: Tier) -> None:
    arr = decode_batch(_pack([0.0, [["BlockStored", [1], None, [], 16, None, medium]]]))
    mp = decode_batch(
        _pack([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": medium}]])
    )
    assert arr.events == [BlockStored((1,), tier)] and mp.events == [BlockRemoved((1,), tier)]


def test_unknown_tags_are_skipped_and_counted() -> None:
    payload = _pack(
        [1.0, [["BlockPinned", [1], 7], {"type": "Future", "x": 1}, ["AllBlocksCleared"]], 0]
    )
    batch = decode_batch(payload)
    assert batch.events == [AllBlocksCleared()] and batch.skipped == 2


def test_map_shaped_outer_batch_is_accepted() -> None:
    payload = _pack({"ts": 2, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3})
    assert decode_batch(payload) == KVEventBatch(2.0, [AllBlocksCleared()], 3)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # reserved byte, not msgpack
        b"\x93\x01",  # truncated
        _pack([1.0, [], 0]) + b"\x00",  # trailing garbage
        _pack(7),
        _pack([1.0]),
        _pack(["yesterday", [], 0]),
        _pack([1.0, {"events": 1}, 0]),
        _pack([1.0, [], "zero"]),
        _pack([1.0, [[]], 0]),
        _pack([1.0, [[42, [1]]], 0]),
        _pack([1.0, ["BlockStored"], 0]),
        _pack([1.0, [["BlockStored", [1], None, []]], 0]),  # too few fields
        _pack([1.0, [["BlockRemoved"]], 0]),
        _pack([1.0, [["BlockRemoved", [1.5]]], 0]),  # float hash
        _pack([1.0, [["BlockRemoved", [True]]], 0]),
        _pack([1.0, [["BlockRemoved", 5]], 0]),
        _pack([1.0, [["BlockRemoved", [1], 3]], 0]),  # medium not a string
        _pack([1.0, [{"type": "BlockStored"}], 0]),
        _pack([1.0, [{"block_hashes": [1]}], 0]),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_encoder_uses_vllm_field_order() -> None:
    events: list[KVEvent] = [BlockStored((5, 6), Tier.HOST), BlockRemoved((5,)), AllBlocksCleared()]
    arr = msgpack.unpackb(encode_batch(events, 3.5, 2, style="array", block_size=32))
    assert arr == [
        3.5,
        [
            ["BlockStored", [5, 6], None, [], 32, None, "CPU"],
            ["BlockRemoved", [5], "GPU"],
            ["AllBlocksCleared"],
        ],
        2,
    ]
    mp = msgpack.unpackb(encode_batch(events, 3.5, None, style="map"))
    assert mp[1][0] == {
        "type": "BlockStored",
        "block_hashes": [5, 6],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
    }
    assert mp[1][2] == {"type": "AllBlocksCleared"} and mp[2] is None
    with pytest.raises(ValueError, match="style"):
        encode_batch(events, 0.0, 0, style="json")  # type: ignore[arg-type]


_hashes = st.lists(st.integers(0, MASK), min_size=1, max_size=5).map(tuple)
_tiers = st.sampled_from(list(Tier))
_events = st.lists(
    st.one_of(
        st.builds(BlockStored, _hashes, _tiers),
        st.builds(BlockRemoved, _hashes, _tiers),
        st.just(AllBlocksCleared()),
    ),
    max_size=8,
)


@given(
    events=_events,
    ts=st.floats(0, 2e9, allow_nan=False),
    rank=st.one_of(st.none(), st.integers(0, 64)),
    style=st.sampled_from(["array", "map"]),
)
def test_encode_decode_round_trip(
    events: list[KVEvent], ts: float, rank: int | None, style: str
) -> None:
    batch = decode_batch(encode_batch(events, ts, rank, style=style))  # type: ignore[arg-type]
    assert batch == KVEventBatch(ts, events, rank)


# --- the subscriber against real sockets ---------------------------------------------------

TOPIC = "kv-events"


def _frames(seq: int, payload: bytes, topic: str = TOPIC) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def _batch(n: int) -> bytes:
    """Batch number n stores block n, so delivery order is visible in the hashes."""
    return encode_batch([BlockStored((n,))], float(n), 0)


async def _wait_for(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class Harness:
    """XPUB (so the test can wait for the subscription: no slow-joiner loss) + subscriber."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        replay_endpoint: str | None = None,
        after_events: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.delivered: list[int] = []
        self.resyncs: list[str] = []
        self.others: list[KVEvent] = []
        self.stop = asyncio.Event()

        def on_events(instance_id: str, events: list[KVEvent]) -> None:
            assert instance_id == "p0"
            for e in events:
                if isinstance(e, BlockStored):
                    self.delivered.extend(e.block_hashes)
                else:
                    self.others.append(e)
            if after_events is not None:
                after_events(self.delivered)

        self.sub = KVEventSubscriber(
            f"tcp://127.0.0.1:{port}",
            "p0",
            on_events,
            topic=TOPIC,
            replay_endpoint=replay_endpoint,
            on_resync=self.resyncs.append,
            poll_interval_s=0.01,
            replay_timeout_s=0.5,
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.sub.run(self.stop))
        sub_msg = await asyncio.wait_for(self.pub.recv(), timeout=3)
        assert sub_msg == b"\x01" + TOPIC.encode()

    async def send(self, seq: int, payload: bytes | None = None, topic: str = TOPIC) -> None:
        await self.pub.send_multipart(_frames(seq, payload or _batch(seq), topic))

    async def finish(self) -> None:
        self.stop.set()
        try:
            if self.task is not None:
                await asyncio.wait_for(self.task, timeout=3)
        finally:
            self.pub.close(linger=0)


async def _serve_replay(
    router: zmq.asyncio.Socket, buffer: dict[int, bytes], log: list[int]
) -> None:
    """What vLLM's publisher does on its ROUTER: stream (seq, payload) >= start, then -1."""
    while True:
        ident, empty, start_bytes = await router.recv_multipart()
        assert empty == b""
        start = int.from_bytes(start_bytes, "big")
        log.append(start)
        for seq in sorted(buffer):
            if seq >= start:
                await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), buffer[seq]])
        await router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])


def test_in_order_stream_and_topic_filter() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        h = Harness(ctx)
        try:
            await h.start()
            for seq in range(3):
                await h.send(seq)
            await h.send(99, topic="other-topic")  # not subscribed: never seen
            await h.send(3, encode_batch([AllBlocksCleared(), BlockStored((3,))], 3.0, 0))
            await _wait_for(lambda: h.delivered == [0, 1, 2, 3])
            assert (
                h.others == [AllBlocksCleared()]
                and h.resyncs == []
                and h.sub.stats.gaps == 0
                and h.sub.stats.received == 4
            )
            assert h.sub.last_seq == 3
        finally:
            await h.finish()
            ctx.destroy(linger=0)

    arun(main())


def test_gap_without_replay_endpoint_resyncs() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        h = Harness(ctx)
        try:
            await h.start()
            for seq in (0, 1, 3):  # seq 2 lost
                await h.send(seq)
            await _wait_for(lambda: h.delivered == [0, 1, 3])
            assert h.resyncs == ["p0"]
            assert (h.sub.stats.gaps, h.sub.stats.resyncs, h.sub.stats.replayed) == (1, 1, 0)
        finally:
            await h.finish()
            ctx.destroy(linger=0)

    arun(main())


def test_gap_is_filled_from_the_replay_router() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        buffer = {seq: _batch(seq) for seq in range(6)}
        requests: list[int] = []
        server = asyncio.create_task(_serve_replay(router, buffer, requests))
        h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}")
        try:
            await h.start()
            for seq in (0, 1, 4, 5):  # 2 and 3 lost on the PUB path
                await h.send(seq)
            await _wait_for(lambda: len(h.delivered) == 6)
            assert h.delivered == [0, 1, 2, 3, 4, 5]  # replayed batches land before seq 4
            assert requests == [2] and h.resyncs == []
            assert (h.sub.stats.gaps, h.sub.stats.replayed) == (1, 2)
        finally:
            await h.finish()
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            router.close(linger=0)
            ctx.destroy(linger=0)

    arun(main())


def test_replay_that_cannot_fill_the_gap_resyncs() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        buffer = {seq: _batch(seq) for seq in (3, 4)}  # seq 2 already rolled out of the buffer
        server = asyncio.create_task(_serve_replay(router, buffer, []))
        h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}")
        try:
            await h.start()
            for seq in (0, 1, 4):
                await h.send(seq)
            await _wait_for(lambda: h.delivered == [0, 1, 4])
            assert h.resyncs == ["p0"] and h.sub.stats.replayed == 0
        finally:
            await h.finish()
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            router.close(linger=0)
            ctx.destroy(linger=0)

    arun(main())


def test_silent_replay_router_times_out_and_resyncs() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)  # bound, never answers
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}")
        try:
            await h.start()
            for seq in (0, 2):
                await h.send(seq)
            await _wait_for(lambda: h.delivered == [0, 2])
            assert h.resyncs == ["p0"]
        finally:
            await h.finish()
            router.close(linger=0)
            ctx.destroy(linger=0)

    arun(main())


def test_publisher_restart_and_bad_batches_resync() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        h = Harness(ctx)
        try:
            await h.start()
            for seq in (0, 1, 2):
                await h.send(seq)
            await _wait_for(lambda: h.delivered == [0, 1, 2])
            await h.send(0, _batch(10))  # sequence went backwards: engine restarted
            await _wait_for(lambda: h.delivered[-1:] == [10])
            assert h.resyncs == ["p0"]
            await h.send(1, b"\xc1")  # undecodable: events were lost
            await h.pub.send_multipart([b"kv-events", b"\x00"])  # bad framing: ignored
            await h.send(2, _batch(11))
            await _wait_for(lambda: h.delivered[-1:] == [11])
            assert h.resyncs == ["p0", "p0"] and h.sub.stats.decode_errors == 2
            await h.send(3, _pack([1.0, [["Mystery"], ["BlockStored", [12], None, [], 16, None]]]))
            await _wait_for(lambda: h.delivered[-1:] == [12])
            assert h.sub.stats.unknown_events == 1
        finally:
            await h.finish()
            ctx.destroy(linger=0)

    arun(main())


def test_a_failing_consumer_triggers_resync_and_the_stream_goes_on() -> None:
    async def main() -> None:
        def flaky(delivered: list[int]) -> None:
            if delivered == [1]:
                raise RuntimeError("index bug")

        ctx = zmq.asyncio.Context()
        h = Harness(ctx, after_events=flaky)
        try:
            await h.start()
            for seq in (0, 1, 2):
                await h.send(seq, _batch(seq + 1))
            await _wait_for(lambda: h.delivered == [1, 2, 3])
            assert h.resyncs == ["p0"] and h.sub.stats.callback_errors == 1
        finally:
            await h.finish()
            ctx.destroy(linger=0)

    arun(main())


def test_close_is_idempotent_and_run_can_restart() -> None:
    async def main() -> None:
        sub = KVEventSubscriber("tcp://127.0.0.1:1", "p0", lambda _i, _e: None)
        stop = asyncio.Event()
        stop.set()
        await sub.run(stop)  # own context: created, used, terminated
        sub.close()
        await sub.run(stop)  # a fresh context is created for the second run
        sub.close()

    arun(main())
