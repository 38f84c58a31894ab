"""The ZMQ KV event subscriber's stream against real sockets on 127.0.0.1: sequence gaps, the
replay ROUTER (both reply shapes), resyncs, restarts. Which side binds, and close/restart of the
subscriber itself: test_kv_events_endpoints.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import pytest
import zmq
import zmq.asyncio

from backends.engine_events import EngineBlockStored, EngineEvent, encode_batch
from backends.kv_events import KVEventSubscriber
from routing.types import AllBlocksCleared

T = TypeVar("T")
# This test file's own loopback ports and socket directory (tests run side by side).
PORT_BASE = 18240
SOCK_DIR = Path(os.environ.get("KVGATE_TEST_TMP", "/tmp")) / f"kvgate-kv-events-{os.getpid()}"


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=15))


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- the subscriber against real sockets ---------------------------------------------------

TOPIC = "kv-events"


def _frames(seq: int, payload: bytes, topic: str = TOPIC) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), payload]


def _batch(n: int) -> bytes:
    """Batch number n stores block n, so delivery order is visible in the hashes."""
    return encode_batch([EngineBlockStored((n,), None, (), 16)], float(n), 0)


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
        self.others: list[EngineEvent] = []
        self.stop = asyncio.Event()

        def on_events(instance_id: str, events: list[EngineEvent]) -> None:
            assert instance_id == "p0"
            for e in events:
                if isinstance(e, EngineBlockStored):
                    self.delivered.extend(e.block_hashes)
                else:
                    self.others.append(e)
            if after_events is not None:
                after_events(self.delivered)

        self.sub = KVEventSubscriber(
            f"tcp://*:{port}",  # the engine binds: the subscriber connects to engine_host
            "p0",
            on_events,
            engine_host="127.0.0.1",
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
    router: zmq.asyncio.Socket, buffer: dict[int, bytes], log: list[int], *, vllm_032: bool = True
) -> None:
    """What a publisher does on its replay ROUTER: stream the batches >= start, then seq -1.
    vLLM 0.32 (``_service_replay``) sends ``[id, b"", topic, seq, payload]`` and ends with
    ``[id, b"", b"", -1, b""]``; the reference protocol (older publishers) has no topic."""
    end = (-1).to_bytes(8, "big", signed=True)
    while True:
        ident, empty, start_bytes = await router.recv_multipart()
        assert empty == b""
        start = int.from_bytes(start_bytes, "big")
        log.append(start)
        topic = [TOPIC.encode()] if vllm_032 else []
        for seq in sorted(buffer):
            if seq >= start:
                frames = [ident, b"", *topic, seq.to_bytes(8, "big"), buffer[seq]]
                await router.send_multipart(frames)
        await router.send_multipart([ident, b"", *([b""] if vllm_032 else []), end, b""])


def test_in_order_stream_and_topic_filter() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        h = Harness(ctx)
        try:
            await h.start()
            for seq in range(3):
                await h.send(seq)
            await h.send(99, topic="other-topic")  # not subscribed: never seen
            stored = EngineBlockStored((3,), None, (), 16)
            await h.send(3, encode_batch([AllBlocksCleared(), stored], 3.0, 0))
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


@pytest.mark.parametrize("vllm_032", [True, False], ids=["vllm-0.32-frames", "topicless-frames"])
def test_gap_is_filled_from_the_replay_router(vllm_032: bool) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        buffer: dict[int, bytes] = {}
        requests: list[int] = []
        server = asyncio.create_task(_serve_replay(router, buffer, requests, vllm_032=vllm_032))
        # vLLM's replay ROUTER binds; a wildcard endpoint is reached at the engine's host.
        h = Harness(ctx, replay_endpoint=f"tcp://*:{port}")
        try:
            await h.start()
            await _wait_for(lambda: requests == [0])  # the start-up catch-up: nothing yet
            buffer.update({seq: _batch(seq) for seq in range(6)})
            for seq in (0, 1, 4, 5):  # 2 and 3 lost on the PUB path
                await h.send(seq)
            await _wait_for(lambda: len(h.delivered) == 6)
            assert h.delivered == [0, 1, 2, 3, 4, 5]  # replayed batches land before seq 4
            assert requests == [0, 2] and h.resyncs == []
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
        buffer: dict[int, bytes] = {}
        requests: list[int] = []
        server = asyncio.create_task(_serve_replay(router, buffer, requests))
        h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}")
        try:
            await h.start()
            await _wait_for(lambda: requests == [0])  # the start-up catch-up: nothing yet
            buffer.update({seq: _batch(seq) for seq in (3, 4)})  # seq 2 already rolled out
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
