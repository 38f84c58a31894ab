"""A gap-aware ZMQ subscriber to one engine's (DP rank's) vLLM KV event publisher.

Which side binds follows vLLM's publisher: it **binds** for ``tcp://*:P``, ``tcp://[::]:P``,
``ipc://`` and ``inproc://`` endpoints and **connects** for ``tcp://host:P`` (then ``host`` is
where the subscriber listens). Configure kvgate with the same endpoint string the engine has
and ``resolve_endpoint`` picks the other side: connect (to the engine's host for a wildcard),
or bind. ``bind`` overrides the rule per instance. Frames are ``[topic, seq (8-byte big-endian),
payload]``; the payload codec is backends/engine_events.py.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from backends.engine_events import EngineEvent, KVEventDecodeError, decode_batch

log = logging.getLogger(__name__)

_END_SEQ = -1  # replay end marker, signed
# Hosts in a tcp:// endpoint that make vLLM's publisher bind (it connects for any other host).
_WILDCARD_HOSTS = ("*", "::", "[::]", "0.0.0.0")


@dataclass(frozen=True, slots=True)
class SubscriberEndpoint:
    """Where the SUB socket goes and whether it binds there or connects."""

    address: str
    bind: bool


def resolve_endpoint(
    endpoint: str, engine_host: str, bind: bool | None = None
) -> SubscriberEndpoint:
    """The subscriber's side of an engine's ``--kv-events-config`` endpoint.

    ``tcp://*:P`` (the engine binds on every interface): connect to ``tcp://engine_host:P``;
    ``ipc://`` / ``inproc://``: connect to it as is; ``tcp://host:P`` (the engine connects to
    ``host``): bind it. ``bind`` forces a side; a wildcard host still becomes ``engine_host``
    when connecting.
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        raise ValueError(f"not a ZMQ endpoint: {endpoint!r}")
    if scheme != "tcp":
        return SubscriberEndpoint(endpoint, bind=bool(bind))
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise ValueError(f"tcp endpoint needs host:port: {endpoint!r}")
    wildcard = host in _WILDCARD_HOSTS
    if bind is None:
        bind = not wildcard
    if not bind and wildcard:
        target = f"[{engine_host}]" if ":" in engine_host else engine_host
        return SubscriberEndpoint(f"tcp://{target}:{port}", bind=False)
    return SubscriberEndpoint(endpoint, bind=bind)


@dataclass(slots=True)
class SubscriberStats:
    received: int = 0  # messages off the SUB socket
    gaps: int = 0  # sequence gaps detected
    replayed: int = 0  # batches recovered through the replay socket
    caught_up: int = 0  # batches from before the first message, replayed on joining
    resyncs: int = 0  # times on_resync was called
    decode_errors: int = 0
    unknown_events: int = 0  # events skipped for an unknown tag
    callback_errors: int = 0  # on_events raised


class KVEventSubscriber:
    """SUB to one engine's (DP rank's) publisher; delivers events in sequence order.

    On a sequence gap it asks the publisher's replay ROUTER for the missing batches; when
    there is no replay endpoint or the replay cannot fill the whole gap (buffer rolled over,
    timeout), it calls ``on_resync(instance_id)`` so the caller drops that instance's cache
    view, which later events rebuild. A sequence that goes backwards means the publisher
    restarted (its cache is empty now), which is also a resync. Joining a publisher whose
    first message is not seq 0 (a restarted gateway, another replica), it first replays what
    the publisher's buffer still holds, so the view includes blocks cached before it joined.

    ``endpoint`` is the engine's own KV event endpoint (see ``resolve_endpoint``;
    ``engine_host`` replaces a wildcard host, ``bind`` forces a side). When the rule says
    bind and the address is already in use, the publisher most likely binds there itself
    (an engine given ``tcp://*:P`` while kvgate was given ``tcp://127.0.0.1:P``): the
    subscriber says so in the log and connects instead.
    """

    def __init__(
        self,
        endpoint: str,
        instance_id: str,
        on_events: Callable[[str, list[EngineEvent]], None],
        *,
        engine_host: str = "127.0.0.1",
        bind: bool | None = None,
        topic: str = "",
        replay_endpoint: str | None = None,
        on_resync: Callable[[str], None] | None = None,
        context: zmq.asyncio.Context | None = None,
        poll_interval_s: float = 0.05,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self.instance_id = instance_id
        self.side = resolve_endpoint(endpoint, engine_host, bind)
        self._bind_by_rule = bind is None
        self.bound: bool | None = None  # how the last run's SUB socket was set up
        self.stats = SubscriberStats()
        self._on_events = on_events
        self._on_resync = on_resync
        self._topic = topic.encode()
        # vLLM's replay ROUTER always binds: the subscriber connects (a wildcard -> the engine).
        self._replay_endpoint = (
            resolve_endpoint(replay_endpoint, engine_host, bind=False).address
            if replay_endpoint is not None
            else None
        )
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.last_seq: int | None = None
        self._replayed_history = False  # last_seq came from the replay buffer, not the stream

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)  # close() must never block on unsent frames
        return sock

    async def run(self, stop: asyncio.Event) -> None:
        """Receive until ``stop`` is set (checked every poll interval); closes on exit."""
        if self._own_ctx and self._ctx.closed:  # run again after a previous run closed it
            self._ctx = zmq.asyncio.Context()
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub = sub
        try:
            self._attach(sub)
            if self._replay_endpoint is not None and self.last_seq is None:
                # Subscribed first, so nothing published from now on is missed; then what
                # the engine cached before this gateway (re)started.
                await self._catch_up(None)
            while not stop.is_set() and self._sub is sub:
                if await sub.poll(self._poll_ms, zmq.POLLIN):
                    await self._handle(await sub.recv_multipart())
        except zmq.ZMQError:
            if self._sub is sub:  # not closed under us by close(): a real failure
                raise
        finally:
            self.close()

    def _attach(self, sub: zmq.asyncio.Socket) -> None:
        address = self.side.address
        if not self.side.bind:
            sub.connect(address)
            self.bound = False
            return
        try:
            sub.bind(address)
            self.bound = True
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or not self._bind_by_rule:
                log.error(
                    "%s: cannot bind the KV event subscriber to %s (%s); vLLM binds for "
                    "tcp://*:P, ipc:// and inproc:// endpoints and connects for tcp://host:P",
                    self.instance_id,
                    address,
                    exc,
                )
                raise
            log.warning(
                "%s: %s is in use, most likely by an engine publisher bound there: connecting "
                "instead (give kvgate the engine's own endpoint, e.g. tcp://*:P, or set "
                "kv_events_bind = false)",
                self.instance_id,
                address,
            )
            sub.connect(address)
            self.bound = False

    def close(self) -> None:
        """Close the sockets (and the context, if this subscriber created it). Idempotent."""
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.destroy(linger=0)

    async def _handle(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.decode_errors += 1
            log.warning("%s: bad KV event frames (%d parts)", self.instance_id, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        last = self.last_seq
        if self._replayed_history and last is not None and seq <= last:
            return  # published before the replay answered: already delivered from the buffer
        self._replayed_history = False
        if last is None and seq > 0:
            # Joining late (a restarted gateway, a new replica): what the engine's replay
            # buffer still holds rebuilds the view of the blocks it cached before.
            await self._catch_up(seq)
        elif last is not None and seq <= last:
            log.info(
                "%s: KV event seq %d after %d, publisher restarted", self.instance_id, seq, last
            )
            self._resync()
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            if not await self._replay_range(last + 1, seq):
                self._resync()
        self.last_seq = seq
        self._deliver(frames[2])

    def _deliver(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            # Lost events (a missed BlockRemoved) would leave phantom cache entries, so a
            # batch we cannot read is treated like a gap we cannot fill.
            self.stats.decode_errors += 1
            log.warning("%s: undecodable KV event batch: %s", self.instance_id, exc)
            self._resync()
            return
        self.stats.unknown_events += batch.skipped
        if not batch.events:
            return
        try:
            self._on_events(self.instance_id, batch.events)
        except Exception:
            # The consumer may have applied part of the batch: its view is now suspect.
            log.exception("%s: on_events callback failed", self.instance_id)
            self.stats.callback_errors += 1
            self._resync()

    def _resync(self) -> None:
        self.stats.resyncs += 1
        if self._on_resync is None:
            return
        try:
            self._on_resync(self.instance_id)
        except Exception:  # a consumer bug must not stop the event stream
            log.exception("%s: on_resync callback failed", self.instance_id)

    async def _replay_range(self, start: int, end: int) -> bool:
        """Fetch and deliver batches ``start..end-1``; False if any of them is missing."""
        got = await self._fetch(start, end)
        if got is None or any(s not in got for s in range(start, end)):
            return False  # replay buffer no longer holds the whole gap
        for s in range(start, end):
            self.stats.replayed += 1
            self._deliver(got[s])
        return True

    async def _catch_up(self, end: int | None) -> None:
        """Delivers the batches before ``end`` (None: all) that the publisher's replay buffer
        still holds: the contiguous run ending at the newest one (a buffer that rolled over
        gives its newest part). Blocks stored before that run stay unknown, an under-count
        the engine's usage reports correct; removals of blocks never seen are no-ops."""
        got = await self._fetch(0, end)
        if not got:
            return
        last = max(got) if end is None else end - 1
        first = last + 1
        while first - 1 in got:
            first -= 1
        for s in range(first, last + 1):
            self.stats.caught_up += 1
            self._deliver(got[s])
        if first <= last:
            if end is None:
                self.last_seq, self._replayed_history = last, True
            log.info(
                "%s: caught up on %d KV event batches (seq %d..%d) from the engine's replay buffer",
                self.instance_id,
                last + 1 - first,
                first,
                last,
            )

    async def _fetch(self, start: int, end: int | None) -> dict[int, bytes] | None:
        """Batches ``start..end-1`` (None: all from ``start``) the replay ROUTER sends; None
        without an endpoint or on a timeout."""
        if self._replay_endpoint is None:
            return None
        if self._replay is None:
            self._replay = self._socket(zmq.DEALER)
            self._replay.connect(self._replay_endpoint)
        sock = self._replay
        # DEALER, not REQ: the ROUTER streams many replies to one request, which REQ's
        # strict send/recv alternation would drop. The empty frame is the REQ envelope.
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        got: dict[int, bytes] = {}
        while True:
            if not await sock.poll(self._replay_timeout_ms, zmq.POLLIN):
                # Drop the socket: late replies to this request must not answer the next one.
                sock.close(linger=0)
                self._replay = None
                log.warning("%s: KV event replay timed out", self.instance_id)
                return None
            reply = await sock.recv_multipart()
            if reply and reply[0] == b"":
                reply = reply[1:]
            # vLLM 0.32 sends [topic, seq, payload] (end: [b"", -1, b""]); older publishers
            # and the reference protocol send [seq, payload].
            if len(reply) == 3:
                reply = reply[1:]
            if len(reply) != 2 or len(reply[0]) != 8:
                continue
            seq = int.from_bytes(reply[0], "big", signed=True)
            if seq == _END_SEQ:
                return got
            if seq >= start and (end is None or seq < end):
                got[seq] = reply[1]
