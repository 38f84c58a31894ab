"""vLLM's KV cache events as the engine sends them: types and the msgpack wire codec.

These carry the *engine's* block hashes (vLLM's seeded sha256 / xxhash, 64-bit), a different
hash space from kvgate's own keys (routing/hashing.py). They are kept as their own types,
rather than as extra fields on ``routing.types.BlockStored``, so that an engine hash can never
reach the KV index by mistake: backends/engine_keys.py rebuilds kvgate's keys from the
``token_ids`` and turns these into ``routing.types`` events.

Wire format (reference/peer-routers.md section 7.1, engines/vllm-cpu/README.md): the payload is
``[ts, events, data_parallel_rank]``; each event is an array with the tag first (vLLM before PR
#42892) or a map with a ``type`` key (after it, e.g. 0.32). Fields were appended over releases
and vLLM omits fields that equal their defaults, so every field after the required ones may be
absent; anything after the fields read here is ignored, and unknown tags are skipped and
counted, so a newer engine's new event kinds do not break an older gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from config.errors import KvgateError
from routing.types import AllBlocksCleared, Tier

_MASK64 = (1 << 64) - 1

# Array-encoded field order after the tag (vLLM's msgspec struct order).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_STORED_REQUIRED = 5  # up to lora_id: present in every release
_TIER_MEDIUM = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.STORE: "DISK"}

ExtraKeys = tuple[object, ...] | None  # one block's untagged extra keys (LoRA name, salt, ...)


class KVEventDecodeError(KvgateError, ValueError):
    """A payload that is not a KV event batch in either known encoding."""


def tier_of(medium: str | None) -> Tier:
    """vLLM's ``medium`` as a cache tier: GPU, CPU (host memory), anything else the slow tier."""
    if medium is None:
        return Tier.GPU  # events from before the medium field existed were all GPU
    kind = medium.upper()
    if kind == "GPU":
        return Tier.GPU
    if kind == "CPU":
        return Tier.HOST
    return Tier.STORE  # DISK, STORAGE and external connector tiers: "shared / slow" to us


@dataclass(frozen=True, slots=True)
class EngineBlockStored:
    """Consecutive blocks one request stored, in the engine's hash space."""

    block_hashes: tuple[int, ...]  # the engine's hashes (u64)
    parent_block_hash: int | None  # the block before the first one; None: a prompt's start
    token_ids: tuple[int, ...]  # all tokens of the blocks (len = blocks x block_size)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # "GPU", "CPU", "DISK", ...; None = GPU
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None  # per block, untagged as vLLM sends them
    group_idx: int = 0  # KV cache group (hybrid models); 0 = the full-attention group
    kv_cache_spec_kind: str | None = None

    @property
    def tier(self) -> Tier:
        return tier_of(self.medium)


@dataclass(frozen=True, slots=True)
class EngineBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int = 0

    @property
    def tier(self) -> Tier:
        return tier_of(self.medium)


EngineEvent = EngineBlockStored | EngineBlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineEventBatch:
    ts: float
    events: list[EngineEvent]
    dp_rank: int | None
    skipped: int = 0  # events with a tag this decoder does not know


# --- decoding ----------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _hash(value: object) -> int:
    # bool is an int subclass; a boolean where a hash belongs is corruption, not a hash.
    if _is_int(value):
        return value & _MASK64  # type: ignore[operator]  # i64 and u64 readers agree
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK64  # vLLM's int-hash convention
    raise KVEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"block_hashes must be a list, got {type(value).__name__}")
    return tuple(_hash(v) for v in value)


def _opt_str(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise KVEventDecodeError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _opt_int(name: str, value: object) -> int | None:
    if value is not None and not _is_int(value):
        raise KVEventDecodeError(f"{name} must be an integer, got {type(value).__name__}")
    return value  # type: ignore[return-value]


def _frozen(value: object) -> object:
    """msgpack arrays as tuples, so extra keys are hashable and events stay immutable."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


def _extra_keys(value: object) -> tuple[ExtraKeys, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"extra_keys must be a list, got {type(value).__name__}")
    out: list[ExtraKeys] = []
    for keys in value:
        if keys is not None and not isinstance(keys, list | tuple):
            raise KVEventDecodeError("each extra_keys entry must be a list or null")
        out.append(None if keys is None else tuple(_frozen(k) for k in keys))
    return tuple(out)


def _token_ids(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(_is_int(t) and t >= 0 for t in value):
        raise KVEventDecodeError("token_ids must be a list of non-negative integers")
    return tuple(value)


def _stored(f: dict[str, Any]) -> EngineBlockStored:
    parent = f.get("parent_block_hash")
    size = f.get("block_size")
    if not _is_int(size) or size < 1:
        raise KVEventDecodeError(f"BlockStored block_size must be a positive integer: {size!r}")
    return EngineBlockStored(
        block_hashes=_hashes(f["block_hashes"]),
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=_token_ids(f.get("token_ids") or ()),
        block_size=size,
        lora_id=_opt_int("lora_id", f.get("lora_id")),
        medium=_opt_str("medium", f.get("medium")),
        lora_name=_opt_str("lora_name", f.get("lora_name")),
        extra_keys=_extra_keys(f.get("extra_keys")),
        group_idx=_opt_int("group_idx", f.get("group_idx")) or 0,
        kv_cache_spec_kind=_opt_str("kv_cache_spec_kind", f.get("kv_cache_spec_kind")),
    )


def _removed(f: dict[str, Any]) -> EngineBlockRemoved:
    return EngineBlockRemoved(
        block_hashes=_hashes(f["block_hashes"]),
        medium=_opt_str("medium", f.get("medium")),
        group_idx=_opt_int("group_idx", f.get("group_idx")) or 0,
    )


def _decode_event(raw: object) -> EngineEvent | None:
    """One event; ``None`` for an unknown tag."""
    if isinstance(raw, list | tuple):
        if not raw or not isinstance(raw[0], str):
            raise KVEventDecodeError("array event must start with its tag")
        tag, values = raw[0], raw[1:]
        if tag == "BlockStored":
            if len(values) < _STORED_REQUIRED:
                raise KVEventDecodeError(f"BlockStored has {len(values)} fields, needs >= 5")
            return _stored(dict(zip(_STORED_FIELDS, values, strict=False)))
        if tag == "BlockRemoved":
            if not values:
                raise KVEventDecodeError("BlockRemoved without block_hashes")
            return _removed(dict(zip(_REMOVED_FIELDS, values, strict=False)))
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KVEventDecodeError("map event without a string 'type'")
        if tag in ("BlockStored", "BlockRemoved"):
            if "block_hashes" not in raw:
                raise KVEventDecodeError(f"{tag} without block_hashes")
            if tag == "BlockStored":
                if "block_size" not in raw:
                    raise KVEventDecodeError("BlockStored without block_size")
                return _stored(raw)
            return _removed(raw)
    else:
        raise KVEventDecodeError(f"event must be an array or a map, got {type(raw).__name__}")
    return AllBlocksCleared() if tag == "AllBlocksCleared" else None


def decode_batch(payload: bytes) -> EngineEventBatch:
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
    if rank is not None and not _is_int(rank):
        raise KVEventDecodeError(f"data_parallel_rank must be an int, got {type(rank).__name__}")
    decoded = [_decode_event(e) for e in events]
    kept = [e for e in decoded if e is not None]
    return EngineEventBatch(float(ts), kept, rank, skipped=len(decoded) - len(kept))


# --- encoding (tests, tools) -------------------------------------------------------------


def _fields(event: EngineEvent) -> tuple[str, tuple[str, ...], list[Any]]:
    if isinstance(event, EngineBlockStored):
        extra = None
        if event.extra_keys is not None:
            extra = [None if k is None else list(k) for k in event.extra_keys]
        values = [
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            extra,
            event.group_idx,
            event.kv_cache_spec_kind,
        ]
        return "BlockStored", _STORED_FIELDS, values
    if isinstance(event, EngineBlockRemoved):
        values = [list(event.block_hashes), event.medium, event.group_idx]
        return "BlockRemoved", _REMOVED_FIELDS, values
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", (), []
    raise TypeError(f"not an engine KV event: {event!r}")


def encode_batch(
    events: Sequence[EngineEvent],
    ts: float,
    dp_rank: int | None,
    *,
    style: Literal["array", "map"] = "map",
) -> bytes:
    """Encode like vLLM's publisher: events as tagged arrays (old) or as maps (0.26+)."""
    if style not in ("array", "map"):
        raise ValueError(f"style must be 'array' or 'map', not {style!r}")
    body: list[Any] = []
    for event in events:
        tag, names, values = _fields(event)
        if style == "array":
            body.append([tag, *values])
        else:
            body.append({"type": tag, **dict(zip(names, values, strict=True))})
    return msgpack.packb([float(ts), body, dp_rank], use_bin_type=True)


def medium_of(tier: Tier) -> str:
    """The ``medium`` string vLLM uses for a tier (the inverse of ``tier_of`` on its names)."""
    return _TIER_MEDIUM[tier]
