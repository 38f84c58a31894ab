"""tiktoken runs a byte-level BPE tokenizer.json with the tokenizers library's ids, or is not
used: supported configurations agree on arbitrary text, the others (and any disagreement on
the probes) fall back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from backends.fast_bpe import PROBES, _plan, stretch_encoder
from backends.model_files import load_prompt_encoder
from routing.token_segments import SegmentedEncoder
from routing.tokenizer import pack_token_ids
from tests.tiny_model import SPECIAL, load_tokenizer, tokenizer_json, write_model_dir

pytest.importorskip("tiktoken")

# Llama 3's pre-tokenizer regex (its tokenizer.json Split pattern).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [*PROBES, "the cache holds the prefix; the gateway routes it. " * 3, "数字 123 456"]


def trained(*, split: str | None = None, nfc: bool = False) -> Any:
    return load_tokenizer(bos=False, split=split, nfc=nfc)


def edited(tok: Any, change: Any) -> Any:
    from tokenizers import Tokenizer

    config = json.loads(tok.to_str())
    change(config)
    return Tokenizer.from_str(json.dumps(config))


TOKENIZERS = {"gpt2_regex": load_tokenizer(), "llama3_split": trained(split=LLAMA3)}
FAST = {name: stretch_encoder(tok) for name, tok in TOKENIZERS.items()}
_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=80)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=300, deadline=None)
@given(text=st.one_of(_text, st.sampled_from(CORPUS)))
def test_same_ids_as_the_tokenizers_library(name: str, text: str) -> None:
    assume(not any(s in text for s in SPECIAL))  # a stretch holds no added token
    fast = FAST[name]
    assert fast is not None
    assert fast.ids(text) == TOKENIZERS[name].encode(text, add_special_tokens=False).ids


def test_nfc_is_applied_first_as_the_normalizer_does() -> None:
    tok = trained(nfc=True)
    fast = stretch_encoder(tok)
    assert fast is not None
    for text in ["e\u0301te\u0301 cafe\u0301", "A\u030a ångström", "plain ascii"]:
        assert fast.ids(text) == tok.encode(text, add_special_tokens=False).ids


def test_a_lone_surrogate_raises_as_the_library_path_does() -> None:
    fast = FAST["gpt2_regex"]
    assert fast is not None
    with pytest.raises(UnicodeEncodeError):
        fast.ids("bad \ud800 text")


def _set(path: list[str], value: Any) -> Any:
    def change(config: dict[str, Any]) -> None:
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _swap_two_merged_ids(config: dict[str, Any]) -> None:
    model = config["model"]
    a, b = ("".join(m.split(" ") if isinstance(m, str) else m) for m in model["merges"][:2])
    model["vocab"][a], model["vocab"][b] = model["vocab"][b], model["vocab"][a]


@pytest.mark.parametrize(
    "change",
    [
        _set(["model", "dropout"], 0.1),
        _set(["model", "continuing_subword_prefix"], "##"),
        _set(["normalizer"], {"type": "Lowercase"}),
        _set(["pre_tokenizer", "add_prefix_space"], True),
        _set(["pre_tokenizer"], {"type": "Metaspace", "replacement": "▁", "split": True}),
        _swap_two_merged_ids,
    ],
    ids=["dropout", "affix", "lowercase", "prefix_space", "metaspace", "ids_out_of_merge_order"],
)
def test_configurations_without_an_exact_counterpart_fall_back(change: Any) -> None:
    config = json.loads(load_tokenizer().to_str())
    change(config)
    assert isinstance(_plan(config), str)  # the reason


def test_a_tokenizer_without_a_plan_keeps_the_library() -> None:
    lowercase = edited(load_tokenizer(), _set(["normalizer"], {"type": "Lowercase"}))
    assert stretch_encoder(lowercase) is None


class Disagreeing:
    """A tokenizer whose config tiktoken can run but whose ids differ (the probes catch it)."""

    def __init__(self) -> None:
        self._tok = load_tokenizer()

    def to_str(self) -> str:
        return str(self._tok.to_str())

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        out = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return type("E", (), {"ids": [*out.ids, 0]})()


def test_a_probe_that_disagrees_keeps_the_library() -> None:
    assert stretch_encoder(Disagreeing()) is None


class WrongStretches:
    def ids(self, text: str) -> list[int]:
        return [1]


def test_the_segmented_encoder_uses_it_and_drops_one_that_disagrees() -> None:
    tok = load_tokenizer()
    fast = SegmentedEncoder(tok, stretches=FAST["gpt2_regex"])
    assert fast.exact and fast.fast
    text = "<s><|im_start|>system\nYou are brief.<|im_end|>\n<|im_start|>user\nhi 数字<|im_end|>\n"
    assert fast.encode(text) == pack_token_ids(tok.encode(text, add_special_tokens=False).ids)
    wrong = SegmentedEncoder(tok, stretches=WrongStretches())
    assert wrong.exact and not wrong.fast  # still split, by the library
    assert wrong.encode(text) == fast.encode(text)


def test_the_model_directory_switch(tmp_path: Any) -> None:
    root = write_model_dir(tmp_path / "m")
    assert load_prompt_encoder(root).segments.fast
    assert not load_prompt_encoder(root, tiktoken=False).segments.fast
    assert tokenizer_json()  # the tiny model is a byte-level BPE: the fast path applies


def test_a_normalized_added_token_inside_a_stretch_goes_to_the_library() -> None:
    """GPT-2's <|endoftext|> is matched after normalization, so the segmented encoder does not
    split at it: a stretch holding one must still get its id."""
    from tokenizers import AddedToken

    tok = trained()
    tok.add_tokens([AddedToken("<|endoftext|>", normalized=True, special=True)])
    fast = stretch_encoder(tok)
    assert fast is not None
    text = "one document<|endoftext|>the next one"
    assert fast.ids(text) == tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id("<|endoftext|>") in fast.ids(text)
