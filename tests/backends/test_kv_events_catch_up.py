"""A subscriber that joins a publisher late (a restarted gateway, another replica) catches up
from the publisher's replay buffer, so blocks cached before it joined are in its view."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from tests.backends.test_kv_events import Harness, _batch, _serve_replay, _wait_for, arun


async def _late_join(buffer_seqs: range, first_live: int, with_router: bool = True):
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    buffer = {seq: _batch(seq) for seq in buffer_seqs}
    requests: list[int] = []
    server = asyncio.create_task(_serve_replay(router, buffer, requests))
    h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}" if with_router else None)
    try:
        await h.start()
        await h.send(first_live)
        await h.send(first_live + 1)
        await _wait_for(lambda: first_live + 1 in h.delivered)
        return list(h.delivered), requests, list(h.resyncs), h.sub.stats
    finally:
        await h.finish()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        router.close(linger=0)
        ctx.destroy(linger=0)


def test_late_joiner_replays_the_whole_history_first() -> None:
    delivered, requests, resyncs, stats = arun(_late_join(range(5), 5))
    assert delivered == [0, 1, 2, 3, 4, 5, 6]  # history first, in order, then the live stream
    assert requests == [0] and resyncs == []
    assert (stats.caught_up, stats.gaps, stats.replayed) == (5, 0, 0)


def test_late_joiner_takes_what_a_rolled_over_buffer_still_holds() -> None:
    delivered, _, resyncs, stats = arun(_late_join(range(3, 9), 9))
    assert delivered == [3, 4, 5, 6, 7, 8, 9, 10]  # seq 0-2 are gone: an under-count, no resync
    assert resyncs == [] and stats.caught_up == 6


def test_late_joiner_without_a_replay_endpoint_starts_from_what_it_hears() -> None:
    delivered, requests, resyncs, stats = arun(_late_join(range(5), 5, with_router=False))
    assert delivered == [5, 6] and requests == [] and stats.caught_up == 0 and resyncs == []


def test_batches_published_while_the_replay_answered_are_not_delivered_twice() -> None:
    async def main() -> tuple[list[int], list[str]]:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        buffer = {seq: _batch(seq) for seq in range(5)}
        server = asyncio.create_task(_serve_replay(router, buffer, []))
        h = Harness(ctx, replay_endpoint=f"tcp://127.0.0.1:{port}")
        try:
            await h.start()
            for seq in (3, 4, 5):  # 3 and 4 reached the SUB socket and the replay buffer both
                await h.send(seq)
            await _wait_for(lambda: 5 in h.delivered)
            return list(h.delivered), list(h.resyncs)
        finally:
            await h.finish()
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
            router.close(linger=0)
            ctx.destroy(linger=0)

    delivered, resyncs = arun(main())
    assert delivered == [0, 1, 2, 3, 4, 5] and resyncs == []  # no "publisher restarted"
