"""Piecewise tokenization between added tokens equals whole-text tokenization, or is not used."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.token_segments import SegmentedEncoder
from routing.tokenizer import pack_token_ids
from tests.tiny_model import SPECIAL, load_tokenizer

TOK = load_tokenizer()


def whole(tok: Any, text: str) -> bytes:
    return pack_token_ids(tok.encode(text, add_special_tokens=False).ids)


_pieces = st.one_of(
    st.sampled_from([*SPECIAL, "<|im_start", "|>", "<", "\n", " ", "  ", "system\n", "user"]),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=12))
def test_segmented_equals_whole_text_encoding(pieces: list[str]) -> None:
    enc = SegmentedEncoder(TOK)
    assert enc.exact
    text = "".join(pieces)
    assert enc.encode(text) == whole(TOK, text)
    assert enc.encode(text) == whole(TOK, text)  # again, from the cache


def test_shared_stretches_are_remembered_and_the_cache_is_bounded() -> None:
    enc = SegmentedEncoder(TOK, max_bytes=4_000)
    system = "<s><|im_start|>system\n" + "You are a careful assistant. " * 40 + "<|im_end|>\n"
    for i in range(20):
        text = f"{system}<|im_start|>user\nquestion {i} " + "x" * 300 + "<|im_end|>\n"
        assert enc.encode(text) == whole(TOK, text)
        assert enc.cached_bytes <= 4_000
    assert enc.cached_bytes > 0


def test_text_without_added_tokens_is_one_stretch() -> None:
    enc = SegmentedEncoder(TOK)
    assert enc.encode("plain text only") == whole(TOK, "plain text only")
    assert enc.encode("") == b""


def test_tokens_that_strip_whitespace_disable_the_split() -> None:
    tok = load_tokenizer(lstrip_token=True)
    enc = SegmentedEncoder(tok)
    assert not enc.exact
    text = "hello   <mask> world<|im_end|>"
    assert enc.encode(text) == whole(tok, text)


def test_a_metaspace_that_prepends_to_the_first_word_only_disables_the_split() -> None:
    from tokenizers import Tokenizer, pre_tokenizers

    tok = Tokenizer.from_str(TOK.to_str())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert not SegmentedEncoder(tok).exact
    assert '"first"' in json.dumps(json.loads(tok.to_str())["pre_tokenizer"])


def test_a_tokenizer_without_added_tokens_never_splits() -> None:
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    enc = SegmentedEncoder(bare)
    assert not enc.exact
    assert enc.encode("a") == pack_token_ids([0])


def test_uncached_lists_what_encode_would_tokenize_and_remember_fills_it() -> None:
    enc = SegmentedEncoder(TOK)
    system = "<s><|im_start|>system\n" + "You are a careful assistant. " * 10 + "<|im_end|>\n"
    text = f"{system}<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    stretches = ["system\n" + "You are a careful assistant. " * 10, "\n", "user\nhello there"]
    assert enc.uncached(text) == [*stretches, "assistant\n"]  # "\n" twice in the text, once here
    for part in enc.uncached(text):
        enc.remember(part, whole(TOK, part))
    assert enc.uncached(text) == []
    cached = enc.cached_bytes
    assert enc.encode(text) == whole(TOK, text)
    assert enc.cached_bytes == cached  # all found: nothing tokenized or added


def test_a_split_that_is_not_exact_tokenizes_the_whole_text_and_remembers_nothing() -> None:
    enc = SegmentedEncoder(load_tokenizer(lstrip_token=True))
    assert enc.uncached("a <mask> b") == ["a <mask> b"]
    enc.remember("a", b"\x00\x00\x00\x00")
    assert enc.cached_bytes == 0
