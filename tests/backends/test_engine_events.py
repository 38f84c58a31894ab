"""vLLM KV event decoding (both encodings, every field, absent fields = defaults), encoding
round trips, and malformed payloads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.engine_events import (
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    EngineEventBatch,
    KVEventDecodeError,
    decode_batch,
    encode_batch,
    medium_of,
    tier_of,
)
from routing.types import AllBlocksCleared, Tier

DATA = Path(__file__).parent / "data"
MASK = (1 << 64) - 1


def _u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & MASK


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _read(name: str) -> bytes:
    return (DATA / f"vllm_kv_events_{name}.msgpack").read_bytes()


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


def test_fixture_array_encoding() -> None:
    raw = msgpack.unpackb(_read("array"))
    assert raw[1][1][7:] == [None, [None], 0, "full_attention", None]  # trailing fields exist
    assert decode_batch(_read("array")) == EngineEventBatch(
        ts=1750000000.125,
        events=[
            EngineBlockStored((1001, 1002), None, tuple(range(32)), 16, medium="GPU"),
            EngineBlockStored(
                (1003,),
                1002,
                tuple(range(32, 48)),
                16,
                medium="CPU",
                extra_keys=(None,),
                kv_cache_spec_kind="full_attention",
            ),
            EngineBlockRemoved((1001,), "GPU"),
            EngineBlockRemoved((1003,), "CPU", 0),
            AllBlocksCleared(),
        ],
        dp_rank=0,
    )


def test_fixture_map_encoding() -> None:
    batch = decode_batch(_read("map"))
    assert batch == EngineEventBatch(
        ts=1750000001.5,
        events=[
            EngineBlockStored(
                (2001, 2002),
                None,
                tuple(range(100, 132)),
                16,
                medium="GPU",
                extra_keys=(None,),
                kv_cache_spec_kind="full_attention",
            ),
            EngineBlockRemoved((2001,), "GPU"),
            AllBlocksCleared(),
        ],
        dp_rank=1,
    )
    assert batch.events[0].tier is Tier.GPU  # type: ignore[union-attr]


def test_fixture_bytes_hashes_and_missing_medium_and_rank() -> None:
    batch = decode_batch(_read("bytes_hashes"))
    h = [_u64(d) for d in SHA]
    assert h[0] == int.from_bytes(SHA[0][-8:], "big")  # the low 64 bits of the digest
    assert batch == EngineEventBatch(
        ts=1750000002.0,
        events=[
            EngineBlockStored((h[0], h[1]), None, tuple(range(32)), 16),
            EngineBlockStored((h[2],), h[1], tuple(range(32, 48)), 16),
            EngineBlockRemoved((h[0],)),
        ],
        dp_rank=None,
    )
    assert all(e.tier is Tier.GPU for e in batch.events)  # type: ignore[union-attr]


# A BlockStored as vLLM 0.32 sends it for a LoRA request with a cache salt (every field).
LORA_SALTED = {
    "type": "BlockStored",
    "block_hashes": [11, 12],
    "parent_block_hash": None,
    "token_ids": list(range(64)),
    "block_size": 32,
    "lora_id": 3,
    "medium": "CPU",
    "lora_name": "sql-adapter",
    "extra_keys": [["sql-adapter", "tenant-7"], ["sql-adapter"]],
    "group_idx": 1,
    "kv_cache_spec_kind": "sliding_window",
    "kv_cache_spec_sliding_window": 128,  # read past: not needed
    "session_id": "s1",
}
LORA_SALTED_DECODED = EngineBlockStored(
    block_hashes=(11, 12),
    parent_block_hash=None,
    token_ids=tuple(range(64)),
    block_size=32,
    lora_id=3,
    medium="CPU",
    lora_name="sql-adapter",
    extra_keys=(("sql-adapter", "tenant-7"), ("sql-adapter",)),
    group_idx=1,
    kv_cache_spec_kind="sliding_window",
)


def test_every_block_stored_field_in_both_encodings() -> None:
    fields = [v for k, v in LORA_SALTED.items() if k != "type"]
    arr = decode_batch(_pack([1.0, [["BlockStored", *fields]], 0]))
    mp = decode_batch(_pack([1.0, [LORA_SALTED], 0]))
    assert arr.events == [LORA_SALTED_DECODED] and mp.events == [LORA_SALTED_DECODED]
    assert mp.events[0].tier is Tier.HOST  # type: ignore[union-attr]


def test_block_removed_fields_in_both_encodings() -> None:
    want = EngineBlockRemoved((7, 8), "DISK", 2)
    arr = decode_batch(_pack([1.0, [["BlockRemoved", [7, 8], "DISK", 2]]]))
    removed = {"type": "BlockRemoved", "block_hashes": [7, 8], "medium": "DISK", "group_idx": 2}
    mp = decode_batch(_pack([1.0, [removed]]))
    assert arr.events == [want] and mp.events == [want] and want.tier is Tier.STORE


def test_absent_optional_fields_take_their_defaults() -> None:
    # vLLM's msgspec omit_defaults drops None fields that have defaults.
    minimal = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": 9,
               "token_ids": [5] * 16, "block_size": 16}  # fmt: skip
    (ev,) = decode_batch(_pack([0.0, [minimal]])).events
    assert ev == EngineBlockStored((1,), 9, (5,) * 16, 16)
    assert (ev.lora_id, ev.lora_name, ev.extra_keys, ev.group_idx, ev.medium) == (
        None,
        None,
        None,
        0,
        None,
    )
    (removed,) = decode_batch(_pack([0.0, [{"type": "BlockRemoved", "block_hashes": [1]}]])).events
    assert removed == EngineBlockRemoved((1,), None, 0)


def test_int_hashes_are_masked_to_64_bits() -> None:
    # Some publishers write the u64 hash as a signed i64; masking makes both readings agree.
    batch = decode_batch(_pack([0.0, [["BlockRemoved", [-1, -(1 << 63), 5], "GPU"]], 0]))
    assert batch.events == [EngineBlockRemoved((MASK, 1 << 63, 5), "GPU")]
    stored = decode_batch(_pack([0.0, [["BlockStored", [1], -2, [], 16, None]]]))
    assert stored.events[0].parent_block_hash == MASK - 1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.GPU),
        ("GPU", Tier.GPU),
        ("CPU", Tier.HOST),
        ("cpu", Tier.HOST),
        ("DISK", Tier.STORE),
        ("STORAGE", Tier.STORE),
        ("LMCache", Tier.STORE),
    ],
)
def test_medium_to_tier(medium: str | None, tier: Tier) -> None:
    assert tier_of(medium) is tier
    arr = decode_batch(_pack([0.0, [["BlockStored", [1], None, [], 16, None, medium]]]))
    assert arr.events[0].tier is tier  # type: ignore[union-attr]
    assert tier_of(medium_of(tier)) is tier


def test_unknown_tags_are_skipped_and_counted() -> None:
    payload = _pack(
        [1.0, [["BlockPinned", [1], 7], {"type": "Future", "x": 1}, ["AllBlocksCleared"]], 0]
    )
    batch = decode_batch(payload)
    assert batch.events == [AllBlocksCleared()] and batch.skipped == 2


def test_map_shaped_outer_batch_is_accepted() -> None:
    payload = _pack({"ts": 2, "events": [["AllBlocksCleared"]], "data_parallel_rank": 3})
    assert decode_batch(payload) == EngineEventBatch(2.0, [AllBlocksCleared()], 3)


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
        _pack([1.0, [["BlockStored", [1], None, [], 0, None]], 0]),  # block size 0
        _pack([1.0, [["BlockStored", [1], None, [1, -2], 16, None]], 0]),  # negative token
        _pack([1.0, [["BlockStored", [1], None, "abc", 16, None]], 0]),
        _pack([1.0, [["BlockStored", [1], None, [], 16, "x"]], 0]),  # lora_id not an int
        _pack([1.0, [["BlockStored", [1], None, [], 16, None, "GPU", 5]], 0]),  # lora_name
        _pack([1.0, [["BlockStored", [1], None, [], 16, None, "GPU", None, 5]], 0]),
        _pack([1.0, [["BlockStored", [1], None, [], 16, None, "GPU", None, [7]]], 0]),
        _pack([1.0, [["BlockStored", [1], None, [], 16, None, "GPU", None, None, "0"]], 0]),
        _pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": []}], 0]),
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


def test_encoder_uses_vllm_field_order_and_names() -> None:
    events: list[EngineEvent] = [
        LORA_SALTED_DECODED,
        EngineBlockRemoved((5,), "GPU"),
        AllBlocksCleared(),
    ]
    arr = msgpack.unpackb(encode_batch(events, 3.5, 2, style="array"))
    assert arr[0] == 3.5 and arr[2] == 2
    assert arr[1][0] == ["BlockStored", *[v for k, v in LORA_SALTED.items() if k != "type"][:10]]
    assert arr[1][1:] == [["BlockRemoved", [5], "GPU", 0], ["AllBlocksCleared"]]
    mp = msgpack.unpackb(encode_batch(events, 3.5, None))
    unread = ("kv_cache_spec_sliding_window", "session_id")
    want = {k: v for k, v in LORA_SALTED.items() if k not in unread}
    assert mp[1][0] == want
    assert mp[1][2] == {"type": "AllBlocksCleared"} and mp[2] is None
    with pytest.raises(ValueError, match="style"):
        encode_batch(events, 0.0, 0, style="json")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode_batch([object()], 0.0, 0)  # type: ignore[list-item]


_hashes = st.lists(st.integers(0, MASK), min_size=1, max_size=4).map(tuple)
_media = st.sampled_from([None, "GPU", "CPU", "DISK"])
_extra = st.one_of(
    st.none(), st.lists(st.one_of(st.none(), st.tuples(st.text(max_size=5))), max_size=3).map(tuple)
)
_stored = st.builds(
    EngineBlockStored,
    _hashes,
    st.one_of(st.none(), st.integers(0, MASK)),
    st.lists(st.integers(0, 2**32 - 1), max_size=8).map(tuple),
    st.integers(1, 64),
    lora_id=st.one_of(st.none(), st.integers(0, 9)),
    medium=_media,
    lora_name=st.one_of(st.none(), st.text(max_size=6)),
    extra_keys=_extra,
    group_idx=st.integers(0, 3),
    kv_cache_spec_kind=st.one_of(st.none(), st.just("full_attention")),
)
_events = st.lists(
    st.one_of(
        _stored,
        st.builds(EngineBlockRemoved, _hashes, _media, st.integers(0, 3)),
        st.just(AllBlocksCleared()),
    ),
    max_size=6,
)


@given(
    events=_events,
    ts=st.floats(0, 2e9, allow_nan=False),
    rank=st.one_of(st.none(), st.integers(0, 64)),
    style=st.sampled_from(["array", "map"]),
)
def test_encode_decode_round_trip(
    events: list[EngineEvent], ts: float, rank: int | None, style: str
) -> None:
    batch = decode_batch(encode_batch(events, ts, rank, style=style))  # type: ignore[arg-type]
    assert batch == EngineEventBatch(ts, events, rank)
