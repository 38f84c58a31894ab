"""Engine block hashes -> kvgate's own keys: block-size ratios both ways, parent chaining,
removal and clear, the bounded map (no phantoms), unknown parents, LoRA / salt namespaces,
extra keys kvgate cannot see, KV cache groups and tiers. The view the events build is checked
in the real KVIndex."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.engine_events import EngineBlockRemoved, EngineBlockStored, EngineEvent
from backends.engine_keys import EngineKeyMap
from routing.hashing import BlockHasher
from routing.kv_index import KVIndex
from routing.tokenizer import pack_token_ids
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

ENGINE_BS = 32


class FakeEngine:
    """Names blocks like an engine would (opaque ids chained over the prefix) and writes the
    BlockStored events vLLM writes: a run of blocks with its parent and its tokens."""

    def __init__(self, block_size: int = ENGINE_BS) -> None:
        self.block_size = block_size
        self._ids: dict[tuple[int, ...], int] = {}
        self._next = itertools.count(1_000_000_007, 7919)

    def hashes(self, tokens: list[int], salt: object = None) -> list[int]:
        """One engine hash per full block; equal prefixes (and salts) give equal hashes."""
        out = []
        for end in range(self.block_size, len(tokens) + 1, self.block_size):
            key = (hash(salt), *tokens[:end])
            if key not in self._ids:
                self._ids[key] = next(self._next)
            out.append(self._ids[key])
        return out

    def stored(
        self, tokens: list[int], first: int, count: int, salt: object = None, **fields: object
    ) -> EngineBlockStored:
        """The event for blocks ``first .. first+count-1`` of the prompt ``tokens``."""
        hashes = self.hashes(tokens, salt)
        size = self.block_size
        return EngineBlockStored(
            block_hashes=tuple(hashes[first : first + count]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(tokens[first * size : (first + count) * size]),
            block_size=size,
            **fields,  # type: ignore[arg-type]
        )


def stored_keys(events: list[KVEvent]) -> list[int]:
    return [k for e in events if isinstance(e, BlockStored) for k in e.block_hashes]


def removed_keys(events: list[KVEvent]) -> list[int]:
    return [k for e in events if isinstance(e, BlockRemoved) for k in e.block_hashes]


def prompt(n: int, start: int = 0) -> list[int]:
    return [(start + i * 37) % 1999 for i in range(n)]


@pytest.mark.parametrize("own_bs", [16, 32])
def test_engine_blocks_equal_or_larger_than_own_blocks(own_bs: int) -> None:
    # Engine 32 / kvgate 16: two own keys per engine block; 32/32: one.
    engine, hasher = FakeEngine(), BlockHasher(own_bs)
    keys = EngineKeyMap(hasher)
    short, long = prompt(100), prompt(100) + prompt(200, 5)
    out = keys.apply([engine.stored(short, 0, 3)])  # 96 of 100 tokens are full blocks
    assert out == [BlockStored(hasher.hash_tokens(short), Tier.GPU)]
    assert len(out[0].block_hashes) == 96 // own_bs  # type: ignore[union-attr]
    # The longer prompt shares 3 engine blocks; vLLM stores only its new blocks 3..8.
    out = keys.apply([engine.stored(long, 3, 6)])
    assert stored_keys(out) == list(hasher.hash_tokens(long)[96 // own_bs :])
    assert keys.stats.stored_blocks == 9 and keys.stats.unknown_parent == 0


@pytest.mark.parametrize("own_bs", [64, 48, 96])
def test_own_blocks_spanning_engine_blocks_carry_tokens(own_bs: int) -> None:
    # kvgate 64 / engine 32: an own block is two engine blocks (48 and 96 too: any ratio).
    engine, hasher = FakeEngine(), BlockHasher(own_bs)
    keys = EngineKeyMap(hasher)
    tokens = prompt(700)
    out: list[KVEvent] = []
    for b in range(700 // ENGINE_BS):  # block by block, as a long prefill stores them
        out += keys.apply([engine.stored(tokens, b, 1)])
    full = 700 // ENGINE_BS * ENGINE_BS
    assert stored_keys(out) == list(hasher.hash_tokens(tokens[:full]))


def test_an_own_block_goes_when_any_engine_block_it_spans_goes() -> None:
    engine, hasher = FakeEngine(), BlockHasher(64)
    keys = EngineKeyMap(hasher)
    tokens = prompt(128)
    e0, e1, e2, e3 = engine.hashes(tokens)
    k0, k1 = hasher.hash_tokens(tokens)
    assert stored_keys(keys.apply([engine.stored(tokens, 0, 4)])) == [k0, k1]
    assert keys.keys_of(e0) == (k0,) and keys.keys_of(e1) == (k0,)
    assert stored_keys(keys.apply([engine.stored(tokens, 0, 4)])) == [k0, k1]  # reported again
    assert keys.keys_of(e0) == (k0,) and len(keys) == 4  # nothing doubled
    assert keys.apply([EngineBlockRemoved((e0,))]) == [BlockRemoved((k0,), Tier.GPU)]
    assert keys.apply([EngineBlockRemoved((e3,))]) == [BlockRemoved((k1,), Tier.GPU)]
    # e1 still maps k0 (already gone from the view; removing it again is harmless).
    assert removed_keys(keys.apply([EngineBlockRemoved((e1, e2))])) == [k0, k1]
    assert len(keys) == 0


def test_a_key_is_not_announced_when_an_engine_block_it_spans_is_gone() -> None:
    engine, hasher = FakeEngine(), BlockHasher(96)  # one own block = three engine blocks
    keys = EngineKeyMap(hasher)
    tokens = prompt(96)
    e0, _, _ = engine.hashes(tokens)
    assert keys.apply([engine.stored(tokens, 0, 2)]) == []  # 64 tokens: nothing complete yet
    keys.apply([EngineBlockRemoved((e0,))])
    assert keys.apply([engine.stored(tokens, 2, 1)]) == []  # e0's tokens are gone
    assert keys.stats.spans_lost == 1


@given(
    n_tokens=st.integers(0, 400),
    own_bs=st.sampled_from([8, 16, 32, 48, 64, 128]),
    cuts=st.lists(st.integers(1, 5), max_size=20),
    seed=st.integers(0, 50),
)
def test_property_any_split_into_events_rebuilds_the_prompt_keys(
    n_tokens: int, own_bs: int, cuts: list[int], seed: int
) -> None:
    engine, hasher = FakeEngine(), BlockHasher(own_bs)
    keys = EngineKeyMap(hasher)
    tokens = prompt(n_tokens, seed)
    n_blocks = n_tokens // ENGINE_BS
    out: list[KVEvent] = []
    first = 0
    for cut in itertools.chain(cuts, itertools.repeat(n_blocks)):
        if first >= n_blocks:
            break
        count = min(cut, n_blocks - first)
        out += keys.apply([engine.stored(tokens, first, count)])
        first += count
    want = hasher.hash_tokens(tokens[: n_blocks * ENGINE_BS])
    assert stored_keys(out) == list(want)


def test_removal_clear_and_the_index_they_build() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys, index = EngineKeyMap(hasher), KVIndex()
    index.add_instance("i0", 1000)

    def apply(events: list[EngineEvent]) -> list[KVEvent]:
        out = keys.apply(events)
        for ev in out:
            index.apply("i0", ev, 0.0)
        return out

    a, b = prompt(128), prompt(64, 9)
    ea, eb = engine.hashes(a), engine.hashes(b)
    apply([engine.stored(a, 0, 4), engine.stored(b, 0, 2)])
    ka, kb = hasher.hash_tokens(a), hasher.hash_tokens(b)
    assert all(index.holds("i0", k) for k in ka + kb)
    out = apply([EngineBlockRemoved((ea[3], ea[2], 12345))])  # tail first, as vLLM evicts
    assert out == [BlockRemoved(ka[6:8] + ka[4:6], Tier.GPU)]
    assert keys.stats.unknown_removed == 1
    assert [index.holds("i0", k) for k in ka] == [True] * 4 + [False] * 4
    assert apply([AllBlocksCleared()]) == [AllBlocksCleared()]
    assert len(keys) == 0 and not any(index.holds("i0", k) for k in ka + kb)
    # After a clear the old parents are unknown: a continuation cannot be chained.
    assert apply([engine.stored(b, 1, 1)]) == [] and keys.stats.unknown_parent == 1
    assert eb[0] not in keys


def test_bounded_map_evicts_mappings_and_their_keys_never_stay_as_phantoms() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys, index = EngineKeyMap(hasher, max_blocks=4), KVIndex()
    index.add_instance("i0", 1000)
    tokens = prompt(6 * ENGINE_BS)
    e = engine.hashes(tokens)
    k = hasher.hash_tokens(tokens)
    out = keys.apply([engine.stored(tokens, 0, 6)])
    for ev in out:
        index.apply("i0", ev, 0.0)
    # Six mappings, room for four: the two least recently used (the first two blocks) go, and
    # with them their keys: the engine may still hold them, but their removal could no longer
    # be applied, so keeping them could leave phantom blocks.
    assert out == [BlockStored(k, Tier.GPU), BlockRemoved(k[:4], Tier.GPU)]
    assert len(keys) == 4 and e[0] not in keys and e[2] in keys
    assert keys.stats.evicted_mappings == 2
    assert [index.holds("i0", h) for h in k] == [False] * 4 + [True] * 8
    # The engine's later removal of an evicted block is unknown and removes nothing else.
    assert keys.apply([EngineBlockRemoved((e[0],))]) == []
    assert keys.stats.unknown_removed == 1
    # Blocks chained to surviving mappings still map.
    more = tokens + prompt(ENGINE_BS, 3)
    assert stored_keys(keys.apply([engine.stored(more, 6, 1)])) == list(
        hasher.hash_tokens(more)[12:]
    )
    with pytest.raises(ValueError, match="max_blocks"):
        EngineKeyMap(hasher, max_blocks=0)


def test_parents_are_kept_warm_by_use() -> None:
    engine, hasher = FakeEngine(), BlockHasher(32)
    keys = EngineKeyMap(hasher, max_blocks=3)
    shared = prompt(ENGINE_BS)
    e0 = engine.hashes(shared)[0]
    keys.apply([engine.stored(shared, 0, 1)])
    for i in range(4):  # four continuations of the same first block
        keys.apply([engine.stored(shared + prompt(ENGINE_BS, 100 + i), 1, 1)])
    assert e0 in keys  # looked up as a parent each time: never the least recently used


def test_unknown_parent_is_skipped_and_counted() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys = EngineKeyMap(hasher)
    tokens = prompt(5 * ENGINE_BS)
    # Joined late: the first event seen continues a chain that was announced before.
    assert keys.apply([engine.stored(tokens, 2, 2)]) == []
    assert keys.apply([engine.stored(tokens, 4, 1)]) == []  # its children cannot chain either
    assert keys.stats.unknown_parent == 3 and len(keys) == 0


def test_lora_and_cache_salt_blocks_live_in_their_own_namespaces() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    tokens = prompt(64)
    packed = pack_token_ids(tokens)
    plain = hasher.hash_tokens(tokens)

    def keys_for(salt: object, first: object, later: object, **fields: object) -> list[int]:
        # As vLLM lists them: the LoRA name on every block, the salt on the first only.
        keys = EngineKeyMap(hasher)
        out = keys.apply([engine.stored(tokens, 0, 1, salt, extra_keys=first, **fields)])
        out += keys.apply([engine.stored(tokens, 1, 1, salt, extra_keys=later, **fields)])
        return stored_keys(out)

    sql = {"lora_name": "sql", "lora_id": 1}
    lora = keys_for("L", (("sql",),), (("sql",),), **sql)
    salted = keys_for("S", (("tenant-7",),), (None,))
    both = keys_for("LS", (("sql", "tenant-7"),), (("sql",),), **sql)
    old_lora = keys_for("O", None, None, lora_id=4)  # before lora_name: the id names it
    sets = [tuple(plain), tuple(lora), tuple(salted), tuple(both), tuple(old_lora)]
    assert len(set(sets)) == 5 and all(len(s) == 4 for s in sets)
    assert tuple(lora) == hasher.hash_packed(packed, root=hasher.namespace_root("sql", None))
    assert tuple(salted) == hasher.hash_packed(packed, root=hasher.namespace_root(None, "tenant-7"))
    assert tuple(both) == hasher.hash_packed(packed, root=hasher.namespace_root("sql", "tenant-7"))
    assert hasher.namespace_root(None, None) == hasher.root  # plain blocks: the usual chain
    assert hasher.namespace_root("x", None) != hasher.namespace_root(None, "x")


def test_extra_keys_a_request_cannot_carry_are_not_mapped() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys = EngineKeyMap(hasher)
    tokens = prompt(3 * ENGINE_BS)
    image = (("mm-hash-1", 0),)  # a multimodal item's (identifier, offset)
    # An image in block 1: block 0 maps, blocks 1 and 2 (which chain over it) do not.
    ev = engine.stored(tokens, 0, 3, extra_keys=(None, image, None))
    assert stored_keys(keys.apply([ev])) == list(hasher.hash_tokens(tokens)[:2])
    assert keys.stats.unsupported_extra_keys == 2
    # Prompt embeddings (bytes) on a first block, or a second string: the root is unknown.
    for extra in ((b"\x00" * 32,), ("salt-a", "salt-b")):
        other = prompt(ENGINE_BS, 50)
        assert keys.apply([engine.stored(other, 0, 1, extra, extra_keys=(extra,))]) == []
    assert keys.stats.unsupported_extra_keys == 4
    # A salt only ever sits on a prompt's first block: elsewhere it is unexplained.
    later = engine.stored(tokens, 1, 1, extra_keys=(("tenant-7",),))
    assert keys.apply([later]) == [] and keys.stats.unsupported_extra_keys == 5


def test_only_kv_cache_group_0_counts() -> None:
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys = EngineKeyMap(hasher)
    tokens = prompt(ENGINE_BS)
    sliding = engine.stored(tokens, 0, 1, group_idx=1, kv_cache_spec_kind="sliding_window")
    assert keys.apply([sliding]) == [] and len(keys) == 0
    assert keys.apply([EngineBlockRemoved(sliding.block_hashes, group_idx=1)]) == []
    assert keys.stats.other_groups == 2
    assert stored_keys(keys.apply([engine.stored(tokens, 0, 1, group_idx=0)]))


def test_media_become_tiers_and_a_block_stays_mapped_while_any_tier_holds_it() -> None:
    engine, hasher = FakeEngine(), BlockHasher(32)
    keys = EngineKeyMap(hasher)
    tokens = prompt(ENGINE_BS)
    (e0,) = engine.hashes(tokens)
    (k0,) = hasher.hash_tokens(tokens)
    assert keys.apply([engine.stored(tokens, 0, 1, medium="GPU")]) == [BlockStored((k0,))]
    cpu = keys.apply([engine.stored(tokens, 0, 1, medium="CPU")])  # offloaded copy
    disk = keys.apply([engine.stored(tokens, 0, 1, medium="DISK")])
    assert cpu == [BlockStored((k0,), Tier.HOST)] and disk == [BlockStored((k0,), Tier.STORE)]
    assert keys.stats.stored_blocks == 1  # one mapping, three tiers
    gpu_gone = keys.apply([EngineBlockRemoved((e0,), "GPU")])
    assert gpu_gone == [BlockRemoved((k0,), Tier.GPU)] and e0 in keys
    keys.apply([EngineBlockRemoved((e0,), "CPU")])
    assert keys.apply([EngineBlockRemoved((e0,), "DISK")]) == [BlockRemoved((k0,), Tier.STORE)]
    assert e0 not in keys


def test_events_without_their_tokens_are_skipped() -> None:
    hasher = BlockHasher(16)
    keys = EngineKeyMap(hasher)
    assert keys.apply([EngineBlockStored((1, 2), None, (), 32)]) == []
    assert keys.apply([EngineBlockStored((3,), None, tuple(range(31)), 32)]) == []
    assert keys.stats.missing_tokens == 3 and len(keys) == 0


def test_stored_again_is_announced_again_without_a_second_mapping() -> None:
    # vLLM reports prefix-cache reuse with BlockStored events for blocks it already holds.
    engine, hasher = FakeEngine(), BlockHasher(16)
    keys = EngineKeyMap(hasher)
    tokens = prompt(64)
    first = keys.apply([engine.stored(tokens, 0, 2)])
    again = keys.apply([engine.stored(tokens, 0, 2)])
    assert first == again and len(keys) == 2 and keys.stats.stored_blocks == 2
    assert keys.keys_of(engine.hashes(tokens)[0]) == hasher.hash_tokens(tokens)[:2]
