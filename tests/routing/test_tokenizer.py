from __future__ import annotations

import math
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.tokenizer import (
    ApproxTokenizer,
    count_tokens,
    pack_token_ids,
    unpack_token_ids,
)


def test_approx_ids_are_short_ascii_chunks_themselves_else_crc32() -> None:
    tok = ApproxTokenizer(4.0)
    assert tok.encode("abcdefghij") == [
        int.from_bytes(b"abcd", "little"),
        int.from_bytes(b"efgh", "little"),
        int.from_bytes(b"ij", "little"),
    ]
    assert tok.encode("") == []
    assert tok.encode("é") == [zlib.crc32("é".encode()) & 0x7FFFFFFF | 0x80]
    # longer ASCII chunks are hashed too, and hashed ids never equal a short chunk's own id
    assert ApproxTokenizer(5.0).encode("abcde") == [zlib.crc32(b"abcde") & 0x7FFFFFFF | 0x80]


def _reference_id(chunk: bytes) -> int:
    """The documented id of a 4-character chunk, one chunk at a time."""
    if len(chunk) <= 4 and chunk.isascii():
        return int.from_bytes(chunk, "little")
    return (zlib.crc32(chunk) & 0x7FFF_FFFF) | 0x80


@settings(max_examples=300)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab?é数\x00🙂 ")), max_size=60)
    | st.text(max_size=300)
    | st.lists(  # mostly ASCII with a few other characters: the runs are found, not walked
        st.text(alphabet="abc ?\n", min_size=0, max_size=90) | st.sampled_from(["é", "数据", "🙂"]),
        max_size=8,
    ).map("".join),
    cpt=st.sampled_from([1.0, 3.0, 3.5, 4.0, 6.0]),
)
def test_approx_pack_is_packed_encode(text: str, cpt: float) -> None:
    tok = ApproxTokenizer(cpt)
    packed = tok.pack(text)
    if cpt == 4.0:
        assert packed is not None
        chunks = [text[i : i + 4].encode() for i in range(0, len(text), 4)]
        assert packed == pack_token_ids([_reference_id(c) for c in chunks])
    if packed is not None:
        assert packed == pack_token_ids(tok.encode(text))
        assert unpack_token_ids(packed) == tok.encode(text)


@given(a=st.text(min_size=1, max_size=4), b=st.text(min_size=1, max_size=4))
def test_approx_distinct_chunks_get_distinct_ids_mostly(a: str, b: str) -> None:
    """Short ASCII chunks are injective (up to trailing NULs); hashed ids never equal them."""
    tok = ApproxTokenizer(4.0)
    ia, ib = tok.encode(a)[0], tok.encode(b)[0]
    if a.isascii() and b.isascii() and a.rstrip("\0") != b.rstrip("\0"):
        assert ia != ib
    if a.isascii() != b.isascii():
        assert ia != ib


@given(text=st.text(max_size=300), cpt=st.sampled_from([1.0, 2.5, 3.7, 4.0, 4.3, 9.0]))
def test_approx_count_and_range(text: str, cpt: float) -> None:
    tok = ApproxTokenizer(cpt)
    ids = tok.encode(text)
    assert len(ids) == tok.count_tokens(text) == count_tokens(text, tok)
    assert len(ids) == math.ceil(len(text) / cpt) or not cpt.is_integer()
    assert abs(len(ids) - len(text) / cpt) <= 1
    assert all(0 <= t < 2**31 for t in ids)


@given(
    prefix=st.text(max_size=200),
    a=st.text(max_size=50),
    b=st.text(max_size=50),
    cpt=st.sampled_from([1.0, 3.0, 3.7, 4.0, 5.5]),
)
def test_approx_prefix_property(prefix: str, a: str, b: str, cpt: float) -> None:
    """Equal text prefixes give equal token prefixes (the full chunks inside the prefix)."""
    tok = ApproxTokenizer(cpt)
    full_chunks = sum(1 for k in range(1, len(prefix) + 1) if int(k * cpt) <= len(prefix))
    assert tok.encode(prefix + a)[:full_chunks] == tok.encode(prefix + b)[:full_chunks]
    assert tok.encode(prefix + a)[:full_chunks] == tok.encode(prefix)[:full_chunks]


def test_approx_deterministic_across_processes() -> None:
    code = (
        "from routing.tokenizer import ApproxTokenizer;"
        "print(ApproxTokenizer(3.5).encode('hello world, kv'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "99", "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout.strip()
    assert out == str(ApproxTokenizer(3.5).encode("hello world, kv"))


def test_approx_rejects_bad_ratio() -> None:
    for bad in (0.0, 0.5, -1.0, float("nan")):
        with pytest.raises(ValueError):
            ApproxTokenizer(bad)


def test_count_tokens_falls_back_to_encode() -> None:
    class Words:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    assert count_tokens("a bb ccc", Words()) == 3


@pytest.mark.parametrize("text", ["a" * 100 + "\ud800" + "é" + "b" * 100, "\ud800数据"])
def test_a_lone_surrogate_raises_as_encoding_does(text: str) -> None:
    # The gateway answers UnicodeEncodeError with a 400 naming the field (gateway/openai.py).
    with pytest.raises(UnicodeEncodeError):
        ApproxTokenizer(4.0).pack(text)
