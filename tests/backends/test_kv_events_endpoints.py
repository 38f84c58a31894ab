"""The KV event subscriber's lifecycle and endpoints against real sockets: close and restart,
and which side binds (vLLM's rule, an ipc publisher, an address in use)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from backends.engine_events import EngineBlockStored, EngineEvent
from backends.kv_events import KVEventSubscriber, SubscriberEndpoint, resolve_endpoint
from tests.backends.test_kv_events import PORT_BASE, SOCK_DIR, _batch, _wait_for, arun


def _port_is_free(port: int) -> bool:
    ctx = zmq.Context()
    probe = ctx.socket(zmq.PUB)
    probe.setsockopt(zmq.LINGER, 0)
    try:
        probe.bind(f"tcp://127.0.0.1:{port}")
        return True
    except zmq.ZMQError:
        return False
    finally:
        probe.close(linger=0)
        ctx.term()


def test_close_is_idempotent_and_run_can_restart() -> None:
    port = PORT_BASE + 1
    assert _port_is_free(port)

    async def main() -> None:
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", "p0", lambda _i, _e: None)
        stop = asyncio.Event()
        stop.set()
        await sub.run(stop)  # own context: created, bound (vLLM connects here), closed
        assert sub.bound is True
        assert _port_is_free(port)  # the run released the address
        sub.close()
        sub.close()  # idempotent
        await sub.run(stop)  # a fresh context is created for the second run: binds again
        assert sub.bound is True and _port_is_free(port)
        sub.close()

    arun(main())


# --- which side binds ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "engine_host", "bind", "want"),
    [
        # vLLM binds: the subscriber connects (a wildcard host -> the engine's host).
        ("tcp://*:5557", "10.0.0.7", None, SubscriberEndpoint("tcp://10.0.0.7:5557", False)),
        ("tcp://[::]:5557", "10.0.0.7", None, SubscriberEndpoint("tcp://10.0.0.7:5557", False)),
        ("tcp://0.0.0.0:5557", "::1", None, SubscriberEndpoint("tcp://[::1]:5557", False)),
        ("ipc:///tmp/kv.sock", "h", None, SubscriberEndpoint("ipc:///tmp/kv.sock", False)),
        ("inproc://kv", "h", None, SubscriberEndpoint("inproc://kv", False)),
        # vLLM connects to tcp://host:P: the subscriber binds there.
        ("tcp://127.0.0.1:5557", "h", None, SubscriberEndpoint("tcp://127.0.0.1:5557", True)),
        ("tcp://gw.local:5557", "h", None, SubscriberEndpoint("tcp://gw.local:5557", True)),
        # Forced by configuration.
        ("tcp://127.0.0.1:5557", "h", False, SubscriberEndpoint("tcp://127.0.0.1:5557", False)),
        ("tcp://*:5557", "h", True, SubscriberEndpoint("tcp://*:5557", True)),
        ("ipc:///tmp/kv.sock", "h", True, SubscriberEndpoint("ipc:///tmp/kv.sock", True)),
    ],
)
def test_resolve_endpoint_follows_vllms_rule(
    endpoint: str, engine_host: str, bind: bool | None, want: SubscriberEndpoint
) -> None:
    assert resolve_endpoint(endpoint, engine_host, bind) == want


@pytest.mark.parametrize("endpoint", ["udp://1.2.3.4:5", "tcp://5557", "tcp://:5557", "kv"])
def test_resolve_endpoint_rejects_non_zmq_endpoints(endpoint: str) -> None:
    with pytest.raises(ValueError, match="endpoint"):
        resolve_endpoint(endpoint, "127.0.0.1")


async def _receive_one(endpoint: str, pub: zmq.asyncio.Socket) -> KVEventSubscriber:
    """Subscribe to ``endpoint``; once the publisher (an XPUB) sees the subscription, send a
    batch storing block 7 and wait until the subscriber delivers it."""
    got: list[int] = []

    def on_events(_instance: str, events: list[EngineEvent]) -> None:
        got.extend(h for e in events if isinstance(e, EngineBlockStored) for h in e.block_hashes)

    sub = KVEventSubscriber(endpoint, "p0", on_events)
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        assert await asyncio.wait_for(pub.recv(), timeout=3) == b"\x01"  # subscribed to all
        await pub.send_multipart([b"kv", (0).to_bytes(8, "big"), _batch(7)])
        await _wait_for(lambda: got == [7])
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=3)
    return sub


def test_subscriber_binds_for_a_publisher_that_connects() -> None:
    # vLLM with endpoint tcp://127.0.0.1:P connects its PUB: the subscriber must bind P.
    port = PORT_BASE + 2

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            pub.connect(f"tcp://127.0.0.1:{port}")  # may come before the bind: ZMQ retries
            sub = await _receive_one(f"tcp://127.0.0.1:{port}", pub)
            assert sub.side == SubscriberEndpoint(f"tcp://127.0.0.1:{port}", bind=True)
            assert sub.bound is True
        finally:
            pub.close(linger=0)
            ctx.destroy(linger=0)

    arun(main())


def test_subscriber_connects_to_an_ipc_publisher() -> None:
    SOCK_DIR.mkdir(parents=True, exist_ok=True)
    path = SOCK_DIR / "engine.sock"

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(f"ipc://{path}")  # vLLM binds ipc:// endpoints
        try:
            sub = await _receive_one(f"ipc://{path}", pub)
            assert sub.bound is False
        finally:
            pub.close(linger=0)
            ctx.destroy(linger=0)

    try:
        arun(main())
    finally:
        path.unlink(missing_ok=True)
        SOCK_DIR.rmdir()


def test_address_in_use_falls_back_to_connect_unless_bind_is_forced() -> None:
    # An engine given tcp://*:P binds P; kvgate given tcp://127.0.0.1:P would bind it too.
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        try:
            sub = await _receive_one(f"tcp://127.0.0.1:{port}", pub)
            assert (
                sub.side.bind and sub.bound is False
            )  # connected to the publisher that holds the address
            forced = KVEventSubscriber(
                f"tcp://127.0.0.1:{port}", "p1", lambda _i, _e: None, bind=True
            )
            with pytest.raises(zmq.ZMQError):
                await forced.run(asyncio.Event())
            assert forced.bound is None
        finally:
            pub.close(linger=0)
            ctx.destroy(linger=0)

    arun(main())
