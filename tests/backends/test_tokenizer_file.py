"""FileTokenizer: the engine's tokenizer.json read at the edge, and load_tokenizer's choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.tokenizer_file import FileTokenizer, load_tokenizer
from routing.tokenizer import ApproxTokenizer, Tokenizer

SENTENCES = [
    "the cache holds the prefix of the prompt",
    "the gateway routes the prompt to the instance",
    "a block of tokens is hashed with its parent",
    "the prefix of the prompt is cached on the instance",
]


def _tiny_tokenizer_file(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_file_tokenizer_roundtrip(tmp_path: Path) -> None:
    path = _tiny_tokenizer_file(tmp_path)
    tok = FileTokenizer(path)
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("the prefix of the prompt")
    assert len(ids) == 5
    assert ids[0] == ids[3]  # "the" twice
    assert tok.encode("the prefix of the prompt zebra")[:5] == ids
    assert tok.count_tokens("the prompt") == 2
    # A second load of the same file gives the same ids.
    assert FileTokenizer(str(path)).encode("the prefix of the prompt") == ids
    assert tok.path == path


def test_file_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        FileTokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot load tokenizer file .*bad\.json"):
        FileTokenizer(bad)


def test_load_tokenizer(tmp_path: Path) -> None:
    approx = load_tokenizer(None, 3.0)
    assert isinstance(approx, ApproxTokenizer) and approx.chars_per_token == 3.0
    path = _tiny_tokenizer_file(tmp_path)
    assert isinstance(load_tokenizer(str(path), 4.0), FileTokenizer)
