"""vLLM KV cache events over ZMQ: decoding, encoding and a gap-aware subscriber.

Wire format (reference/peer-routers.md section 7.1): PUB multipart ``[topic, seq (8-byte
big-endian), msgpack payload]``; the payload is ``[ts, events, data_parallel_rank]`` and each
event is either an array with the tag first (vLLM before PR #42892) or a map with a ``type``
key (after it). Fields have been appended over releases, so the decoder reads the fields it
needs by position / key and ignores anything after them; unknown tags are skipped and
counted, so a newer engine's new event kinds do not break an older gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq
import zmq.asyncio

from routing.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_END_SEQ = -1  # replay end marker, signed
_TIER_MEDIUM = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.STORE: "DISK"}


class KVEventDecodeError(ValueError):
    """A payload that is not a KV event batch in either known encoding."""


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent]
    dp_rank: int | None
    skipped: int = 0  # events with a tag this decoder does not know


def _hash(value: object) -> int:
    # bool is an int subclass; a boolean where a hash belongs is corruption, not a hash.
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _MASK64  # signed i64 readers and u64 readers agree after masking
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK64  # vLLM's int-hash convention
    raise KVEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"block_hashes must be a list, got {type(value).__name__}")
    return tuple(_hash(v) for v in value)


def _tier(medium: object) -> Tier:
    if medium is None:
        return Tier.GPU  # events from before the medium field existed were all GPU
    if not isinstance(medium, str):
        raise KVEventDecodeError(f"medium must be a string, got {type(medium).__name__}")
    kind = medium.upper()
    if kind == "GPU":
        return Tier.GPU
    if kind == "CPU":
        return Tier.HOST
    return Tier.STORE  # disk and external connector tiers are all "shared / slow" to us


def _decode_event(raw: object) -> KVEvent | None:
    """One event; ``None`` for an unknown tag."""
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise KVEventDecodeError("array event must start with its tag")
        tag, fields = raw[0], raw[1:]
        if tag == "BlockStored":
            # [hashes, parent, token_ids, block_size, lora_id, medium?, lora_name?, ...]
            if len(fields) < 5:
                raise KVEventDecodeError(f"BlockStored has {len(fields)} fields, needs >= 5")
            return BlockStored(_hashes(fields[0]), _tier(fields[5] if len(fields) > 5 else None))
        if tag == "BlockRemoved":
            if len(fields) < 1:  # [hashes, medium?, group_idx?]
                raise KVEventDecodeError("BlockRemoved without block_hashes")
            return BlockRemoved(_hashes(fields[0]), _tier(fields[1] if len(fields) > 1 else None))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KVEventDecodeError("map event without a string 'type'")
        if tag in ("BlockStored", "BlockRemoved"):
            if "block_hashes" not in raw:
                raise KVEventDecodeError(f"{tag} without block_hashes")
            kind = BlockStored if tag == "BlockStored" else BlockRemoved
            return kind(_hashes(raw["block_hashes"]), _tier(raw.get("medium")))
    else:
        raise KVEventDecodeError(f"event must be an array or a map, got {type(raw).__name__}")
    return AllBlocksCleared() if tag == "AllBlocksCleared" else None


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one msgpack ``KVEventBatch`` in the array or the map encoding."""
    try:
        outer = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:  # ExtraData, FormatError, ...
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if isinstance(outer, list | tuple):
        # omit_defaults=True drops a trailing dp_rank that equals its default (None).
        if len(outer) not in (2, 3):
            raise KVEventDecodeError(f"batch array has {len(outer)} items, expected 2 or 3")
        ts, events, rank = outer[0], outer[1], outer[2] if len(outer) == 3 else None
    elif isinstance(outer, dict):
        ts, events = outer.get("ts"), outer.get("events")
        rank = outer.get("data_parallel_rank", outer.get("dp_rank"))
    else:
        raise KVEventDecodeError(f"batch must be an array or a map, got {type(outer).__name__}")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventDecodeError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list | tuple):
        raise KVEventDecodeError(f"batch events must be a list, got {type(events).__name__}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise KVEventDecodeError(f"data_parallel_rank must be an int, got {type(rank).__name__}")
    decoded = [_decode_event(e) for e in events]
    kept = [e for e in decoded if e is not None]
    return KVEventBatch(float(ts), kept, rank, skipped=len(decoded) - len(kept))


def _encode_event(event: KVEvent, style: str, block_size: int) -> list[Any] | dict[str, Any]:
    if isinstance(event, BlockStored):
        hashes, medium = list(event.block_hashes), _TIER_MEDIUM[event.tier]
        # parent / token ids are not carried by routing.types; consumers key on the hashes.
        fields = [hashes, None, [], block_size, None, medium]
        keys = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
        names = (*keys, "medium")
    elif isinstance(event, BlockRemoved):
        fields = [list(event.block_hashes), _TIER_MEDIUM[event.tier]]
        names = ("block_hashes", "medium")
    elif isinstance(event, AllBlocksCleared):
        fields, names = [], ()
    else:
        raise TypeError(f"not a KV event: {event!r}")
    tag = type(event).__name__
    if style == "array":
        return [tag, *fields]
    return {"type": tag, **dict(zip(names, fields, strict=True))}


def encode_batch(
    events: Sequence[KVEvent],
    ts: float,
    dp_rank: int | None,
    *,
    style: Literal["array", "map"] = "array",
    block_size: int = 16,
) -> bytes:
    """Encode like vLLM's publisher (``style``: events as tagged arrays or as maps)."""
    if style not in ("array", "map"):
        raise ValueError(f"style must be 'array' or 'map', not {style!r}")
    body = [float(ts), [_encode_event(e, style, block_size) for e in events], dp_rank]
    return msgpack.packb(body, use_bin_type=True)


@dataclass(slots=True)
class SubscriberStats:
    received: int = 0  # messages off the SUB socket
    gaps: int = 0  # sequence gaps detected
    replayed: int = 0  # batches recovered through the replay socket
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
    restarted (its cache is empty now), which is also a resync.
    """

    def __init__(
        self,
        endpoint: str,
        instance_id: str,
        on_events: Callable[[str, list[KVEvent]], None],
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        on_resync: Callable[[str], None] | None = None,
        context: zmq.asyncio.Context | None = None,
        poll_interval_s: float = 0.05,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self.instance_id = instance_id
        self.stats = SubscriberStats()
        self._on_events = on_events
        self._on_resync = on_resync
        self._topic = topic.encode()
        self._replay_endpoint = replay_endpoint
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.asyncio.Context()
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._replay_timeout_ms = max(1, int(replay_timeout_s * 1000))
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.last_seq: int | None = None

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
        sub.connect(self.endpoint)
        self._sub = sub
        try:
            while not stop.is_set() and self._sub is sub:
                if await sub.poll(self._poll_ms, zmq.POLLIN):
                    await self._handle(await sub.recv_multipart())
        except zmq.ZMQError:
            if self._sub is sub:  # not closed under us by close(): a real failure
                raise
        finally:
            self.close()

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
        # The first message is the baseline, whatever its seq: a subscriber that joins late
        # starts from an empty view anyway, and replaying a publisher's whole history buffer
        # (which may already have rolled over) would not make that view complete.
        last = self.last_seq
        if last is not None and seq <= last:
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
        if self._replay_endpoint is None:
            return False
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
                return False
            reply = await sock.recv_multipart()
            if reply and reply[0] == b"":
                reply = reply[1:]
            if len(reply) != 2 or len(reply[0]) != 8:
                continue
            seq = int.from_bytes(reply[0], "big", signed=True)
            if seq == _END_SEQ:
                break
            if start <= seq < end:
                got[seq] = reply[1]
        if any(s not in got for s in range(start, end)):
            return False  # replay buffer no longer holds the whole gap
        for s in range(start, end):
            self.stats.replayed += 1
            self._deliver(got[s])
        return True
