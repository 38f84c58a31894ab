from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.hashing import (
    HASH_MASK,
    BlockHasher,
    block_tokens_for_id,
    common_prefix_blocks,
    hash_ids_to_blocks,
)
from routing.tokenizer import ApproxTokenizer, pack_token_ids

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=200)


def _reference(tokens: list[int], block_size: int, seed: int = 0) -> tuple[int, ...]:
    """The documented construction, written out plainly with struct."""
    import struct

    key = seed.to_bytes(8, "little")
    parent = bytes(8)
    out = []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size : (b + 1) * block_size]
        data = parent + struct.pack(f"<{block_size}I", *block)
        parent = hashlib.blake2b(data, digest_size=8, key=key).digest()
        out.append(int.from_bytes(parent, "little") & HASH_MASK)
    return tuple(out)


@pytest.mark.parametrize("block_size", [16, 512])
def test_matches_documented_construction(block_size: int) -> None:
    tokens = list(range(3 * block_size + 5))
    hashes = BlockHasher(block_size).hash_tokens(tokens)
    assert len(hashes) == 3
    assert hashes == _reference(tokens, block_size)
    assert all(0 <= h < 2**63 for h in hashes)


@given(tokens=tokens_st, block_size=st.sampled_from([1, 4, 16]))
def test_property_equals_reference(tokens: list[int], block_size: int) -> None:
    assert BlockHasher(block_size).hash_tokens(tokens) == _reference(tokens, block_size)


@settings(max_examples=60)
@given(
    prompts=st.lists(st.lists(st.integers(0, 50), max_size=40), min_size=1, max_size=8),
    memo_blocks=st.sampled_from([0, 1, 3, 1000]),
)
def test_memo_never_changes_a_hash_and_stays_bounded(
    prompts: list[list[int]], memo_blocks: int
) -> None:
    """One hasher reused across prompts (small vocab: many repeated blocks hit the memo)."""
    h = BlockHasher(4, memo_blocks=memo_blocks)
    for tokens in prompts + prompts:
        assert h.hash_tokens(tokens) == _reference(tokens, 4)
        assert len(h._memo) <= memo_blocks


def test_deterministic_across_processes() -> None:
    """No hash(): a fresh interpreter (different hash randomisation) gives the same ids."""
    code = (
        "from routing.hashing import BlockHasher;"
        "print(BlockHasher(16, seed=7).hash_tokens(list(range(64))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout.strip()
    assert out == str(BlockHasher(16, seed=7).hash_tokens(list(range(64))))


@pytest.mark.parametrize("block_size", [16, 512])
def test_partial_block_ignored(block_size: int) -> None:
    h = BlockHasher(block_size)
    full = list(range(2 * block_size))
    assert h.hash_tokens([*full, 1, 2, 3]) == h.hash_tokens(full)
    assert h.hash_tokens(full[: block_size - 1]) == ()
    assert h.hash_tokens([]) == ()
    assert h.num_blocks([*full, 1]) == 2
    assert h.num_blocks(2 * block_size - 1) == 1


@pytest.mark.parametrize("block_size", [16, 512])
def test_chaining_change_propagates_forward_only(block_size: int) -> None:
    h = BlockHasher(block_size)
    tokens = list(range(4 * block_size))
    base = h.hash_tokens(tokens)
    changed = list(tokens)
    changed[2 * block_size + 3] += 1  # inside block 2
    after = h.hash_tokens(changed)
    assert after[:2] == base[:2]
    assert all(a != b for a, b in zip(after[2:], base[2:], strict=True))


def test_same_block_content_at_different_positions_differs() -> None:
    h = BlockHasher(4)
    hashes = h.hash_tokens([5, 5, 5, 5] * 3)
    assert len(set(hashes)) == 3  # the parent chain makes position part of the identity


def test_prefix_property() -> None:
    h = BlockHasher(16)
    long = list(range(1000))
    assert h.hash_tokens(long[:480]) == h.hash_tokens(long)[:30]


def test_seed_separates_hash_spaces() -> None:
    tokens = list(range(64))
    assert BlockHasher(16, seed=0).hash_tokens(tokens) != BlockHasher(16, seed=1).hash_tokens(
        tokens
    )
    assert BlockHasher(16, 3).hash_tokens(tokens) == BlockHasher(16, 3).hash_tokens(tokens)


@settings(max_examples=80)
@given(
    base=st.lists(st.integers(0, 3), min_size=4, max_size=40),
    tails=st.lists(
        st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=30)),
        min_size=1,
        max_size=12,
    ),
    chains=st.sampled_from([0, 1, 2, 32]),
    salted=st.booleans(),
)
def test_recent_prompts_never_change_a_hash_and_stay_bounded(
    base: list[int], tails: list[tuple[int, list[int]]], chains: int, salted: bool
) -> None:
    """Prompts cut from one base at random points with random tails (shared first blocks,
    prefixes diverging anywhere, shorter and longer than the remembered ones), plain and
    salted: the same hashes as the plain construction, with or without remembered chains."""
    h = BlockHasher(4, memo_blocks=0, chains=chains)
    ref = BlockHasher(4, memo_blocks=0, chains=0)
    root = h.namespace_root(None, "salt") if salted else h.root
    for cut, tail in tails + tails:
        tokens = base[:cut] + tail
        packed = pack_token_ids(tokens[: len(tokens) // 4 * 4])
        assert h.hash_packed(packed, root) == ref.hash_packed(packed, root)
        assert h.hash_tokens(tokens) == _reference(tokens, 4)
        assert len(h._chains) <= chains


def test_a_remembered_prompt_is_not_the_callers_buffer() -> None:
    h = BlockHasher(2)
    buf = bytearray(pack_token_ids([1, 2, 3, 4]))
    first = h.hash_packed(buf)  # type: ignore[arg-type]
    buf[:] = pack_token_ids([9, 9, 9, 9])
    assert h.hash_packed(pack_token_ids([1, 2, 3, 4])) == first == _reference([1, 2, 3, 4], 2)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(ValueError):
        BlockHasher(16, seed=-1)
    with pytest.raises(ValueError):
        BlockHasher(16, memo_blocks=-1)
    with pytest.raises(ValueError):
        BlockHasher(16, chains=-1)
    with pytest.raises(ValueError):
        BlockHasher(2).hash_tokens([1, -1])
    with pytest.raises(ValueError):
        BlockHasher(2).hash_tokens([1, 2**32])


def test_hash_text_returns_hashes_and_token_count() -> None:
    tok = ApproxTokenizer(4.0)
    h = BlockHasher(16)
    text = "x" * 300  # 75 tokens -> 4 full blocks
    hashes, n = h.hash_text(text, tok)
    assert n == 75
    assert hashes == h.hash_tokens(tok.encode(text))
    assert len(hashes) == 4


def test_hash_ids_to_blocks() -> None:
    assert hash_ids_to_blocks([0, 1, 46, 2**40]) == (0, 1, 46, 2**40)
    assert hash_ids_to_blocks([2**64 - 1]) == (HASH_MASK,)
    assert hash_ids_to_blocks(()) == ()


@pytest.mark.parametrize("block_size", [16, 512])
def test_block_tokens_for_id(block_size: int) -> None:
    a = block_tokens_for_id(42, block_size)
    assert len(a) == block_size
    assert a == block_tokens_for_id(42, block_size)
    assert a != block_tokens_for_id(43, block_size)
    assert a != block_tokens_for_id(42, block_size, seed=1)
    assert all(0 <= t < 32000 for t in a)
    assert all(0 <= t < 7 for t in block_tokens_for_id(42, block_size, vocab=7))
    # Shorter blocks are prefixes of longer ones for the same id (counter-mode stream).
    assert block_tokens_for_id(42, 512)[:block_size] == a


def test_block_tokens_pinned_values() -> None:
    """Pinned so that a change of construction (and so of replayed prompts) is noticed."""
    key = bytes(8)
    digest = hashlib.blake2b(
        (1).to_bytes(8, "little") + bytes(8), digest_size=64, key=key, person=b"kvgate-tokens"
    ).digest()
    first = int.from_bytes(digest[:4], "little") % 32000
    assert block_tokens_for_id(1, 16)[0] == first


def test_trace_ids_to_tokens_share_prefixes() -> None:
    """Live replay: shared hash ids -> shared token prefixes -> shared block hashes."""
    h = BlockHasher(16)

    def prompt(ids: list[int]) -> list[int]:
        return [t for i in ids for t in block_tokens_for_id(i, 16)]

    a = h.hash_tokens(prompt([1, 2, 3]))
    b = h.hash_tokens(prompt([1, 2, 9]))
    assert a[:2] == b[:2] and a[2] != b[2]


@settings(max_examples=50)
@given(prefix=tokens_st, a=tokens_st, b=tokens_st)
def test_property_common_prefix_common_hashes(
    prefix: list[int], a: list[int], b: list[int]
) -> None:
    h = BlockHasher(4)
    k = len(prefix) // 4
    assert h.hash_tokens(prefix + a)[:k] == h.hash_tokens(prefix + b)[:k]


@settings(max_examples=50)
@given(tokens=tokens_st, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_continue_chain_in_any_pieces_equals_one_pass(tokens: list[int], cuts: list[int]) -> None:
    # How engine events are re-keyed: the chain continues from a digest, partial blocks carried.
    h = BlockHasher(4, memo_blocks=8)
    packed = pack_token_ids(tokens)
    keys: list[int] = []
    digest, carry, pos = h.root, b"", 0
    for cut in [*cuts, len(tokens)]:
        piece = packed[pos * 4 : (pos + cut) * 4]
        pos += cut
        got, digest = h.continue_chain(digest, carry + piece)
        carry = (carry + piece)[len(got) * 16 :]
        keys.extend(got)
    assert tuple(keys) == _reference(tokens, 4) == h.hash_packed(packed)
    assert h.continue_chain(digest, b"\0" * 8) == ((), digest)  # no full block: same digest


def test_namespace_roots_separate_hash_spaces() -> None:
    h = BlockHasher(4)
    packed = pack_token_ids(list(range(8)))
    plain = h.hash_packed(packed)
    roots = {
        (lora, salt): h.namespace_root(lora, salt)
        for lora in (None, "a", "b")
        for salt in (None, "a", "s")
    }
    assert roots[(None, None)] == h.root == bytes(8)
    assert len(set(roots.values())) == len(roots)  # no two namespaces share a root
    spaces = {h.hash_packed(packed, root=r) for r in roots.values()}
    assert len(spaces) == len(roots) and plain in spaces
    assert h.namespace_root("a", None) == BlockHasher(4).namespace_root("a", None)  # stable
    assert h.namespace_root("a", None) != BlockHasher(4, seed=1).namespace_root("a", None)
    assert h.continue_chain(roots[("a", None)], packed)[0] == h.hash_packed(
        packed, root=roots[("a", None)]
    )
    for r in roots.values():  # token ids (a partial block dropped) hash the same way
        assert h.hash_tokens([*range(8), 99], r) == h.hash_packed(packed, root=r)


def _chained(tokens: list[int]) -> tuple[int, ...]:
    """Block keys as kvgate makes them: each names its whole prefix (above)."""
    return tuple(hash(tuple(tokens[: i + 1])) for i in range(len(tokens)))


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12))
def test_common_prefix_bisection_agrees_with_a_plain_scan(a: list[int], b: list[int]):
    plain = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    expected = min(len(a), len(b)) if plain is None else plain
    assert common_prefix_blocks(_chained(a), _chained(b)) == expected
