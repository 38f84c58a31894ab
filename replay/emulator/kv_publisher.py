"""vLLM-style KV cache events over ZMQ PUB, sourced from the emulated engine's prefix cache.

Wire format (reference/peer-routers.md section 7.1): multipart ``[topic, seq (8-byte
big-endian, +1 per message), msgpack payload]``, payload ``[ts, events, 0]`` (the outer batch
is always an array; 0 = data-parallel rank). Events come in vLLM's two encodings: arrays with
the tag first (before PR #42892) or maps with a ``type`` key (after it).

Like vLLM, the events name blocks by vLLM's own hashes (vllm_hashing.py) and carry the
token ids, never kvgate's keys, which the emulator's engine model uses inside: a gateway must
rebuild its keys from the tokens, as it must in front of a real vLLM. A small encoder of its
own (not backends.engine_events) keeps the emulator independent of the gateway side it is used
to test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import zmq

from replay.emulator.config import KVEventsFormat
from replay.emulator.vllm_hashing import (
    PLAIN,
    BlockNamespace,
    VllmBlockHashes,
    external_hash,
    stand_in_digest,
)
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

log = logging.getLogger(__name__)

_MEDIUM = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.STORE: "DISK"}


@dataclass(frozen=True, slots=True)
class StoredRun:
    """Consecutive stored blocks of one prompt, in the emulator's own block keys: what one
    vLLM BlockStored event describes."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    medium: str = "GPU"
    # The whole prompt and the run's first block in it: rebuilds the parent's vLLM hash
    # when it is not known any more.
    prompt_tokens: Sequence[int] | None = field(default=None, compare=False, repr=False)
    start_block: int = field(default=0, compare=False)
    space: BlockNamespace = PLAIN  # the prompt's LoRA adapter / cache salt


@dataclass(frozen=True, slots=True)
class VllmStored:
    """A BlockStored as vLLM sends it: vLLM's hashes (u64), parent, tokens, and the
    adapter / salt keys the hashes were made with."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    medium: str = "GPU"
    space: BlockNamespace = PLAIN
    start_block: int = 0  # the run's first block in its prompt (a salt keys block 0 only)


@dataclass(frozen=True, slots=True)
class VllmRemoved:
    block_hashes: tuple[int, ...]  # vLLM's hashes (u64)
    medium: str = "GPU"


class PromptBlocks(Protocol):
    """What the encoder needs to know about a prompt whose blocks were stored."""

    @property
    def block_hashes(self) -> tuple[int, ...]: ...

    @property
    def token_ids(self) -> Sequence[int] | None: ...

    @property
    def space(self) -> BlockNamespace: ...


def stored_runs(
    event: BlockStored, prompts: Sequence[PromptBlocks], block_size: int
) -> list[StoredRun]:
    """Split a PrefixCache BlockStored into vLLM events with parents and token ids.

    The cache reports the blocks a prompt added (usually its tail after the cached prefix);
    vLLM reports each contiguous run with the hash of the block before it as the parent and
    the run's tokens. Blocks of no known prompt chain to the previous hash in the event.
    """
    where: dict[int, tuple[PromptBlocks, int]] = {}
    for p in prompts:
        for pos, h in enumerate(p.block_hashes):
            where.setdefault(h, (p, pos))
    medium = _MEDIUM.get(event.tier, "GPU")
    hashes = event.block_hashes
    runs: list[StoredRun] = []
    i = 0
    while i < len(hashes):
        loc = where.get(hashes[i])
        j = i + 1
        if loc is None:
            while j < len(hashes) and hashes[j] not in where:
                j += 1
            parent = hashes[i - 1] if i > 0 else None
            runs.append(StoredRun(hashes[i:j], parent, (), medium))
        else:
            prompt, pos = loc
            chain = prompt.block_hashes
            while j < len(hashes) and pos + j - i < len(chain) and chain[pos + j - i] == hashes[j]:
                j += 1
            tokens: tuple[int, ...] = ()
            if prompt.token_ids is not None:
                tokens = tuple(prompt.token_ids[pos * block_size : (pos + j - i) * block_size])
            parent = chain[pos - 1] if pos > 0 else None
            runs.append(
                StoredRun(hashes[i:j], parent, tokens, medium, prompt.token_ids, pos, prompt.space)
            )
        i = j
    return runs


def to_vllm(run: StoredRun, hashes: VllmBlockHashes) -> VllmStored:
    """Name a run's blocks (and its parent) by vLLM's hashes, remembering them in ``hashes``."""
    if run.token_ids:
        parent, digests = hashes.chain(
            run.block_hashes,
            run.token_ids,
            run.parent_block_hash,
            run.prompt_tokens,
            run.start_block,
            run.space,
        )
    else:  # a copy fetched without its tokens: vLLM has no such event; a token-less stand-in
        key = run.parent_block_hash
        parent = None if key is None else (hashes.get(key) or stand_in_digest(key))
        digests = [hashes.stand_in(k) for k in run.block_hashes]
    return VllmStored(
        tuple(external_hash(d) for d in digests),
        None if parent is None else external_hash(parent),
        run.token_ids,
        run.medium,
        run.space,
        run.start_block,
    )


def encode_event(
    item: VllmStored | VllmRemoved | AllBlocksCleared, fmt: KVEventsFormat, block_size: int
) -> Any:
    """One event in vLLM's array (before PR #42892) or map encoding (0.32's field set)."""
    if isinstance(item, VllmStored):
        hashes, tokens, space = list(item.block_hashes), list(item.token_ids), item.space
        extra = [space.event_keys(item.start_block + i) for i in range(len(hashes))]
        if fmt == "array":
            head = ["BlockStored", hashes, item.parent_block_hash, tokens, block_size]
            head += [space.lora_id, item.medium]
            if space == PLAIN:  # the field set of the releases that sent arrays
                return head
            return [*head, space.lora_name, extra]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": item.parent_block_hash,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": space.lora_id,
            "medium": item.medium,
            "lora_name": space.lora_name,
            "extra_keys": extra,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": None,
            "locality": None,
            "ownership": None,
            "session_id": None,
        }
    if isinstance(item, VllmRemoved):
        if fmt == "array":
            return ["BlockRemoved", list(item.block_hashes), item.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(item.block_hashes),
            "medium": item.medium,
            "group_idx": 0,
        }
    if isinstance(item, AllBlocksCleared):
        return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"cannot encode {item!r}")  # emulator-keyed events go through to_vllm


def encode_payload(events: Sequence[Any], ts: float) -> bytes:
    """The msgpack batch ``[ts, events, dp_rank]`` around already encoded events."""
    packed: bytes = msgpack.packb([ts, list(events), 0], use_bin_type=True)
    return packed


class KVEventPublisher:
    """A PUB socket bound to ``tcp://host:port`` (port 0 = ephemeral)."""

    def __init__(
        self, host: str, port: int, *, topic: str, fmt: KVEventsFormat, block_size: int
    ) -> None:
        self.fmt: KVEventsFormat = fmt
        self.block_size = block_size
        self.topic = topic.encode()
        self.seq = 0
        self.hashes = VllmBlockHashes(block_size)
        # Its own context (not zmq.Context.instance()): no process-wide state, clean close.
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's default hwm
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = f"tcp://{host}:{self.port}"

    def publish(self, events: Sequence[KVEvent], prompts: Sequence[PromptBlocks] = ()) -> None:
        encoded: list[Any] = []
        size = self.block_size
        for ev in events:
            if isinstance(ev, BlockStored):
                runs = stored_runs(ev, prompts, size)
                encoded.extend(encode_event(to_vllm(r, self.hashes), self.fmt, size) for r in runs)
            elif isinstance(ev, BlockRemoved):
                gone = tuple(external_hash(self.hashes.forget(h)) for h in ev.block_hashes)
                medium = _MEDIUM.get(ev.tier, "GPU")
                encoded.append(encode_event(VllmRemoved(gone, medium), self.fmt, size))
            else:
                self.hashes.clear()
                encoded.append(encode_event(ev, self.fmt, size))
        if not encoded:
            return
        payload = encode_payload(encoded, time.time())
        frames = [self.topic, self.seq.to_bytes(8, "big"), payload]
        self.seq += 1  # consumed even if dropped, so subscribers see the gap
        try:
            # PUB never blocks on slow subscribers; NOBLOCK keeps it so even at the HWM.
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch %d dropped (send queue full)", self.seq - 1)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
