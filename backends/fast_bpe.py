"""A byte-level BPE ``tokenizer.json`` run by ``tiktoken``: the same ids as the ``tokenizers``
library for the stretches of a prompt between added tokens, at about a third of the CPU.

On the gateway's hot path the exact prompt identity tokenizes each request's new text (a user
turn); ``tokenizers`` takes ~34 µs for a 190-character turn here, ``tiktoken`` ~11 µs for the
same ids (docs/real-engines.md §1). The two run the same algorithm for the GPT-2 family of
tokenizers (GPT-2, Llama 3, Qwen 2 ...): a regex cuts the text into pieces,
each piece's UTF-8 bytes are merged pairwise, lowest rank first. ``tiktoken`` ranks a merge by
the id of the token it makes, ``tokenizers`` by the merge's line in ``merges``; the two orders
agree when the ids of the merged tokens grow with their merge lines, which is how these
vocabularies were built (``tiktoken``'s own GPT-2 loader asserts the same of GPT-2's files).

Only configurations whose every step has that counterpart are taken (``stretch_encoder``
returns None otherwise, and says why): a BPE model without dropout, byte fallback or affixes;
no normalizer or NFC; a ``ByteLevel`` pre-tokenizer with its own regex, or one regex ``Split``
(isolated) followed by a ``ByteLevel`` without it; no prefix space. Then probe texts (scripts,
digits, whitespace runs, contractions, emoji, code) must tokenize to the same ids both ways,
or the library's encoder stays in use.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from typing import Any

log = logging.getLogger(__name__)

# tokenizers' ByteLevel pre-tokenizer regex (use_regex=True), GPT-2's.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PROBES = (
    "The quick brown fox jumps over the lazy dog; it's 12:45, isn't it? I'll see. We've done.",
    "  leading spaces,\ttabs\t\tand\n\n\nnew lines   \n  trailing  ",
    "ünïcödé Système: réponds en français, s'il te plaît. Ünïcode — “quotes” … ß ﬁ",
    "数字 123456 中文文本，日本語のテキスト、한국어 텍스트 ไทย العربية עברית",
    "emoji 😀🎉👍🏽 👨‍👩‍👧 ✓ ★ → ∑ ∫ ≠ €£¥ ©®™",
    'def f(x):\n    return {"a": [1, 2.5e-3, -7], "b": None}  # code\r\n\tx += 0x1F',
    "1234567890 3.14159 1,000,000 2026-11-29 v0.32.0 ID-0042 $19.99 50%",
    "A\u0301 e\u0301 combining marks, zero\u200bwidth, NBSP\u00a0here, soft\u00adhyphen",
    "CAPS lock AND MiXeD cAsE words; URLs https://example.com/a?b=c&d=e#f",
    "'S 'T 'RE 'VE 'M 'LL 'D contractions in caps, and 'quoted' words",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (``ByteLevel``'s)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


class TiktokenStretches:
    """``ids(text)`` = ``tokenizer.encode(text, add_special_tokens=False).ids`` for text that
    holds no added token the segmented encoder splits at (routing.token_segments'
    ``StretchEncoder``). Added tokens matched after normalization (``normalized: true``, such
    as GPT-2's ``<|endoftext|>``) are not split there: a text holding one goes to
    ``tokenizer`` itself."""

    __slots__ = ("_encode", "_guard", "_nfc", "_tokenizer")

    def __init__(
        self, encoding: Any, tokenizer: Any, *, nfc: bool, guard: tuple[str, ...] = ()
    ) -> None:
        self._encode = encoding.encode_ordinary
        self._tokenizer = tokenizer
        self._nfc = nfc
        self._guard = guard  # the normalized added tokens' texts

    def ids(self, text: str) -> list[int]:
        if not text.isascii():
            # tiktoken replaces a lone surrogate silently; raise what the library path raises.
            text.encode()
            if self._nfc:
                text = unicodedata.normalize("NFC", text)
        if self._guard and any(token in text for token in self._guard):
            ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
            return ids
        ids = self._encode(text)
        return ids


def stretch_encoder(tokenizer: Any) -> TiktokenStretches | None:
    """``tokenizer`` (a ``tokenizers.Tokenizer``) as a ``TiktokenStretches``, or None when its
    configuration has no exact ``tiktoken`` counterpart, ``tiktoken`` is missing, or a probe
    disagrees (the reason is logged)."""
    try:
        import tiktoken
    except ImportError:  # pragma: no cover - depends on the environment
        log.info("tiktoken not installed: prompts are tokenized by the tokenizers library")
        return None
    config = json.loads(tokenizer.to_str())
    plan = _plan(config)
    if isinstance(plan, str):
        log.info("tokenizer not run by tiktoken (%s): the tokenizers library tokenizes", plan)
        return None
    pattern, ranks, nfc = plan
    try:
        encoding = tiktoken.Encoding(
            "kvgate-byte-level-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except Exception as exc:  # a regex tiktoken's engine does not accept, say
        log.info("tokenizer not run by tiktoken (%s): the tokenizers library tokenizes", exc)
        return None
    guard = tuple(t["content"] for t in config.get("added_tokens") or [] if t.get("normalized"))
    fast = TiktokenStretches(encoding, tokenizer, nfc=nfc, guard=guard)
    for probe in PROBES:
        if fast.ids(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
            log.warning(
                "tiktoken and tokenizers disagree on %r: the tokenizers library tokenizes",
                probe[:40],
            )
            return None
    return fast


def _plan(config: dict[str, Any]) -> tuple[str, dict[bytes, int], bool] | str:
    """(regex, mergeable ranks, NFC first) for ``tiktoken``, or why there is none."""
    model = config.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')!r}, not BPE"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE {key} {model[key]!r}"
    if model.get("byte_fallback"):
        return "BPE byte_fallback"
    nfc = _nfc(config.get("normalizer"))
    if nfc is None:
        return f"normalizer {config.get('normalizer')!r}"
    pattern = _pattern(config.get("pre_tokenizer"))
    if pattern is None:
        return f"pre-tokenizer {config.get('pre_tokenizer')!r}"
    ranks = _ranks(model.get("vocab") or {}, model.get("merges") or [])
    return (pattern, ranks, nfc) if isinstance(ranks, dict) else ranks


def _nfc(normalizer: Any) -> bool | None:
    """False: none; True: NFC; None: anything else."""
    if normalizer is None:
        return False
    kind = normalizer.get("type")
    if kind == "NFC":
        return True
    if kind == "Sequence":
        steps = normalizer.get("normalizers") or []
        if not steps:
            return False
        if len(steps) == 1:
            return _nfc(steps[0])
    return None


def _pattern(pre: Any) -> str | None:
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    regex = (split.get("pattern") or {}).get("Regex")
    if (
        split.get("type") != "Split"
        or not isinstance(regex, str)
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    return regex


def _ranks(vocab: dict[str, int], merges: list[Any]) -> dict[bytes, int] | str:
    """Every byte and every merged token, ranked by its id; or why the ids do not order the
    merges as their lines do."""
    chars = bytes_to_unicode()
    to_byte = {c: b for b, c in chars.items()}
    ranks: dict[bytes, int] = {}
    for b, c in chars.items():
        if c not in vocab:
            return f"byte {b:#04x} has no token"
        ranks[bytes([b])] = vocab[c]
    last = -1
    for line in merges:
        left, right = line.split(" ", 1) if isinstance(line, str) else line
        merged = left + right
        tid = vocab.get(merged)
        if tid is None or tid <= last:
            return f"merge {left!r} + {right!r}: ids do not follow the merge order"
        try:
            ranks[bytes(to_byte[c] for c in merged)] = tid
        except KeyError:
            return f"merge {left!r} + {right!r}: not byte-level text"
        last = tid
    return ranks
