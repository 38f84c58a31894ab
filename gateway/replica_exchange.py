"""The replica exchange: several kvgate replicas share their dispatched-but-unfinished work.

Each replica binds one ZMQ PUB socket (``replicas.bind``) and connects one SUB socket to every
peer's (``replicas.peers``). Every ``publish_interval_s`` it publishes a msgpack snapshot of its
own work per instance (routing/replica_load.own_work) with its replica id, a per-run epoch and a
sequence number; what it receives goes into its books through ``ReplicaLoad.set_peer_load``,
where admission and placement count it as load. A peer not heard from for ``ttl_s`` (default 3
intervals) has its share expire; a replica that shuts down cleanly says goodbye so its share
goes at once. Whole snapshots, not deltas: PUB/SUB may drop (slow joiner, high-water mark)
and that costs only freshness. Besides the interval, a replica publishes right after each of
its dispatches (at most one snapshot per ``gap``, which grows with the snapshot's own cost):
arrivals come in bursts that a load balancer spreads over all replicas at the same instant,
and a replica that learns of its peers' share of a burst only at their next interval predicts
queues (and admits) as if the burst were its share alone. Brokerless: no server to run,
nothing to keep consistent (docs/replicas.md says why ZMQ rather than NATS or Redis).

Wire: frames ``[b"kvgate.books", payload]``, the payload a snapshot
(gateway/replica_snapshot.py). Besides the work, the socket carries which instance made each
Responses API answer (gateway/replica_owners.py, its own topic), so that a follow-up reaches
the instance that holds its response from any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq
import zmq.asyncio

from config.replica_settings import ReplicasSettings
from gateway.replica_owners import OWNERS_TOPIC, OwnerBook, OwnerRelay, OwnersError
from gateway.replica_snapshot import Snapshot, SnapshotError, decode, encode
from routing.conductor import Conductor
from routing.replica_load import ReplicaLoad, own_work

log = logging.getLogger("kvgate.replicas")

TOPIC = b"kvgate.books"

# Publishing on dispatch (and catching up before each decision; ``replicas.
# publish_on_dispatch``, on by default): a token bucket of DISPATCH_BURST
# snapshots refilled one per gap, the gap GAP_COST_FACTOR times a snapshot's own cost (at
# least MIN_DISPATCH_GAP_S): on average at most ~1/GAP_COST_FACTOR of a core goes to them,
# however many requests are in flight.
DISPATCH_BURST = 8
MIN_DISPATCH_GAP_S = 0.001
GAP_COST_FACTOR = 50.0


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@dataclass(slots=True)
class ExchangeStats:
    published: int = 0
    received: int = 0  # snapshots applied
    stale: int = 0  # older than one already applied
    invalid: int = 0
    expired: int = 0  # peer shares dropped for silence
    on_dispatch: int = 0  # of ``published``: right after a dispatch, not on the interval


class ReplicaExchange:
    """One replica's end of the exchange; ``start`` binds, ``run`` publishes and merges."""

    def __init__(
        self,
        cfg: ReplicasSettings,
        conductor: Conductor,
        clock: Callable[[], float],
        *,
        context: zmq.asyncio.Context | None = None,
        publish_on_dispatch: bool | None = None,
        owners: OwnerBook | None = None,
    ) -> None:
        self.cfg = cfg
        self.replica_id = cfg.replica_id or f"{socket.gethostname()}:{os.getpid()}"
        self.ttl_s = cfg.ttl_s if cfg.ttl_s is not None else 3 * cfg.publish_interval_s
        self.conductor = conductor
        self.load = ReplicaLoad(conductor.instances)
        self.clock = clock
        self.stats = ExchangeStats()
        self._epoch = secrets.randbits(62)  # a restarted replica's sequence starts over
        self._seq = 0
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self.publish_on_dispatch = (
            cfg.publish_on_dispatch if publish_on_dispatch is None else publish_on_dispatch
        )
        self.gap_s = MIN_DISPATCH_GAP_S  # refill period of the dispatch bucket; adapts to cost
        self._tokens = float(DISPATCH_BURST)
        self._refilled = time.perf_counter()
        self._deferred: asyncio.TimerHandle | None = None
        self._hooked = False
        self._endpoint: str | None = None
        self.owners = OwnerRelay(owners, self.replica_id) if owners is not None else None

    def start(self) -> None:
        """Bind and connect now, so a taken port fails start-up with a clear message."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 64)  # a stuck peer drops snapshots; newer ones follow
        try:
            pub.bind(self.cfg.bind)
        except zmq.ZMQError as exc:
            pub.close()
            raise RuntimeError(f"replicas.bind {self.cfg.bind}: {exc}") from exc
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        if self.owners is not None:
            sub.setsockopt(zmq.SUBSCRIBE, OWNERS_TOPIC)
        sub.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # a snapshot is ~25 bytes a request
        for peer in self.cfg.peers:
            sub.connect(peer)  # ZMQ reconnects by itself while a peer is down
        self._pub, self._sub = pub, sub
        self._endpoint = pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        if self.publish_on_dispatch:
            self._hook_conductor()
        if self.cfg.rotate_ties:
            self.conductor.rotate_ties(self.rank)
        log.info(
            "replica %s publishes on %s, peers %s", self.replica_id, self.cfg.bind, self.cfg.peers
        )

    @property
    def rank(self) -> int:
        """This replica's position among all the replicas' endpoints (its own + ``peers``,
        sorted): the same list on every replica, so each gets its own rank without config.
        Its own is the bound one once started (a ``*`` port resolved)."""
        own = self._endpoint or self.cfg.bind
        return sorted({own, *self.cfg.peers}).index(own)

    def snapshot(self, now: float, bye: bool = False) -> Snapshot:
        self._seq += 1
        work = {} if bye else own_work(self.conductor.requests, self.conductor.instances, now)
        return Snapshot(self.replica_id, self._epoch, self._seq, work, bye)

    def publish(self, bye: bool = False) -> bool:
        if self._pub is None:
            return False
        t0 = time.perf_counter()
        payload = encode(self.snapshot(self.clock(), bye))
        sent = False
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([TOPIC, payload], flags=zmq.NOBLOCK)
            self.stats.published += 1
            sent = True
        self.gap_s = max(MIN_DISPATCH_GAP_S, GAP_COST_FACTOR * (time.perf_counter() - t0))
        return sent

    # ---- at decision time: peers' newest work in, own dispatch out ----
    def _hook_conductor(self) -> None:
        """Before each ``Conductor.schedule`` apply what the peers sent since the event loop
        last ran (``catch_up``); after each ``dispatched`` publish (``dispatched``). A burst's
        requests are scheduled one after another within one turn of the event loop, where
        the receiving task cannot run: these hooks let each decision see the peers'
        dispatches that have reached the socket by then (serve and epp alike)."""
        if self._hooked:
            return
        self.conductor.before_schedule.append(self.catch_up)
        self.conductor.after_dispatch.append(self.dispatched)
        self._hooked = True

    def _unhook_conductor(self) -> None:
        if self._hooked:
            self.conductor.before_schedule.remove(self.catch_up)
            self.conductor.after_dispatch.remove(self.dispatched)
            self._hooked = False

    def catch_up(self) -> int:
        """Apply the snapshots waiting on the socket now; returns how many arrived."""
        sub = self._sub
        # EVENTS first: one getsockopt where a receive would build a future for nothing.
        if sub is None or not sub.getsockopt(zmq.EVENTS) & zmq.POLLIN or not _in_event_loop():
            return 0
        payloads = self._pending(sub)
        if payloads:
            self.receive(payloads)
        return len(payloads)

    def dispatched(self) -> None:
        """This replica just dispatched a request: publish now. A token bucket bounds the
        cost: ``DISPATCH_BURST`` snapshots at once, then one per ``gap_s`` (the rest of a burst
        goes out in one snapshot at the end of the gap)."""
        if self._pub is None or not _in_event_loop():
            return  # the sockets are asyncio's: without a running loop, the interval covers it
        if self._take_token():
            if self.publish():
                self.stats.on_dispatch += 1
        elif self._deferred is None:  # else a publish is already due
            wait = (1.0 - self._tokens) * self.gap_s
            self._deferred = asyncio.get_running_loop().call_later(wait, self._publish_deferred)

    def _take_token(self) -> bool:
        now = time.perf_counter()
        self._tokens = min(DISPATCH_BURST, self._tokens + (now - self._refilled) / self.gap_s)
        self._refilled = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _publish_deferred(self) -> None:
        self._deferred = None
        if not self._take_token():  # the timer fired a hair early: spend what has refilled
            self._tokens = 0.0
        if self.publish():
            self.stats.on_dispatch += 1

    def receive(self, payloads: list[bytes]) -> None:
        """Apply the newest snapshot of each peer among ``payloads`` (oldest first)."""
        latest: dict[str, Snapshot] = {}
        for payload in payloads:
            try:
                snap = decode(payload)
            except SnapshotError as exc:
                self.stats.invalid += 1
                log.warning("ignoring a replica snapshot: %s", exc)
                continue
            if snap.replica != self.replica_id:
                latest[snap.replica] = snap
        now = self.clock()
        for snap in latest.values():
            if snap.bye:
                self.load.forget(snap.replica, now)
                self.stats.received += 1
            elif self.load.set_peer_load(
                snap.replica, snap.work, now, ttl_s=self.ttl_s, seq=snap.seq, epoch=snap.epoch
            ):
                self.stats.received += 1
            else:
                self.stats.stale += 1

    async def run(self, stop: asyncio.Event) -> None:
        if self._pub is None:
            self.start()
        sub = self._sub
        assert sub is not None
        interval = self.cfg.publish_interval_s
        next_pub = self.clock()
        try:
            while not stop.is_set():
                # What arrived while this loop was held up (a busy event loop) is applied
                # before expiring: a live peer's share must not lapse for our own delay.
                self.receive(self._pending(sub))
                now = self.clock()
                self.stats.expired += len(self.load.expire(now))
                if now >= next_pub:
                    self.publish()
                    self._publish_owners()
                    next_pub = now + interval
                await sub.poll(max(int((next_pub - self.clock()) * 1000), 0), zmq.POLLIN)
        except zmq.ZMQError:
            if not stop.is_set() and self._sub is not None:
                raise

    def _publish_owners(self) -> None:
        payload = self.owners.next_message() if self.owners is not None else None
        if payload is not None and self._pub is not None:
            with contextlib.suppress(zmq.Again):  # the next message repeats them
                self._pub.send_multipart([OWNERS_TOPIC, payload], flags=zmq.NOBLOCK)

    def _pending(self, sub: zmq.asyncio.Socket, limit: int = 1000) -> list[bytes]:
        """What waits on the socket, without waiting (a NOBLOCK receive of an asyncio socket
        completes at once: synchronous, so ``catch_up`` can run inside a decision). Work
        snapshots are returned; response owners go to their book at once."""
        payloads: list[bytes] = []
        for _ in range(limit):
            fut = sub.recv_multipart(flags=zmq.NOBLOCK)
            if not fut.done() or fut.exception() is not None:  # zmq.Again: nothing more
                fut.cancel()
                break
            frames = fut.result()
            if len(frames) == 2 and frames[0] == TOPIC:
                payloads.append(frames[1])
            elif len(frames) == 2 and frames[0] == OWNERS_TOPIC and self.owners is not None:
                try:
                    self.owners.receive(frames[1])
                except OwnersError as exc:
                    self.stats.invalid += 1
                    log.warning("ignoring a replica's response owners: %s", exc)
            else:
                self.stats.invalid += 1
        return payloads

    def close(self) -> None:
        """Say goodbye (peers drop this replica's share at once) and close the sockets; the
        peers' shares leave these books too."""
        self._unhook_conductor()
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
        with contextlib.suppress(zmq.ZMQError):
            self.publish(bye=True)
        if self._pub is not None:
            self._pub.close(linger=100)  # long enough for the goodbye to leave on loopback
        if self._sub is not None:
            self._sub.close(linger=0)
        self._pub = self._sub = None
        self.load.clear(self.clock())
        if self._own_ctx:
            self._ctx.term()

    @property
    def peers(self) -> Mapping[str, float]:
        return self.load.peers
