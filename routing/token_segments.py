"""Tokenize a rendered chat piecewise, remembering the pieces a shared prefix is made of.

The ``tokenizers`` library cuts the text at added tokens matched on the raw text (those with
``normalized: false``, special or not; leftmost-longest) *before* normalizing,
pre-tokenizing and running the model, so the stretches between them are tokenized
independently: the ids of the whole text are the concatenation of the ids of its stretches
and of the added tokens. A rendered chat is full of such tokens (``<|im_start|>``), so its
shared system prompt is one stretch and is tokenized once, then found in a bounded LRU.

This only holds when no added token strips or claims the whitespace around it (``lstrip``,
``rstrip``, ``single_word``), the tokenizer is not told to encode special tokens as text, and
nothing depends on a stretch's position in the text (a Metaspace pre-tokenizer that prepends
to the first word only). ``SegmentedEncoder.exact`` is False otherwise, and also when a probe
encoded both ways at construction disagrees; callers then encode the whole text.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any, Protocol

from routing.tokenizer import pack_token_ids


class StretchEncoder(Protocol):
    """Tokenizes text that holds no added token as ``EngineTokenizer.encode(text,
    add_special_tokens=False)`` does, faster (backends/fast_bpe.py); pure, so safe in a worker
    thread."""

    def ids(self, text: str) -> list[int]: ...


class EngineTokenizer(Protocol):
    """What kvgate uses of a ``tokenizers.Tokenizer``."""

    def encode(self, sequence: str, add_special_tokens: bool = ...) -> Any: ...  # .ids
    def get_added_tokens_decoder(self) -> dict[int, Any]: ...  # AddedToken per id
    def to_str(self) -> str: ...  # the tokenizer.json text


def token_ids(tokenizer: EngineTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode(text).ids`` through ``encode_batch_fast`` where the library has it
    (tokenizers >= 0.21): the same ids without computing character offsets, ~25% less CPU."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    try:
        if fast is not None:
            ids: list[int] = fast([text], add_special_tokens=add_special_tokens)[0].ids
            return ids
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
    except TypeError:
        # tokenizers refuses a str holding a lone surrogate with a TypeError: raise what
        # str.encode (and so every other encoder) raises for it, UnicodeEncodeError.
        text.encode()
        raise


_PROBES = (
    "plain words, then\n\nnew lines  and  spaces",
    " leading space",
    "ünïcödé 数字 123456 \t tab",
)


def _position_dependent(config: Any) -> bool:
    """A Metaspace component that prepends only to the first word of the text."""
    if isinstance(config, dict):
        if config.get("prepend_scheme") == "first":
            return True
        return any(_position_dependent(v) for v in config.values())
    if isinstance(config, list):
        return any(_position_dependent(v) for v in config)
    return False


class SegmentedEncoder:
    """``encode(text)`` = the tokenizer's ``encode(text, add_special_tokens=False)`` as packed
    uint32 ids, stretches between added tokens memoized (at most ``max_bytes`` of text and
    ids held; least recently used dropped first)."""

    __slots__ = (
        "_bytes", "_cache", "_max_bytes", "_split", "_stretches", "_tok", "_token_bytes", "exact"
    )  # fmt: skip

    def __init__(
        self,
        tokenizer: EngineTokenizer,
        *,
        max_bytes: int = 32 << 20,
        stretches: StretchEncoder | None = None,
    ) -> None:
        self._tok = tokenizer
        self._stretches = stretches  # a faster encoder of the stretches, if the model has one
        self._max_bytes = max_bytes
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        raw = {
            str(t.content): tid
            for tid, t in tokenizer.get_added_tokens_decoder().items()
            if not t.normalized
        }
        self._token_bytes = {content: pack_token_ids([tid]) for content, tid in raw.items()}
        # Longest first: Python's alternation is leftmost-first, tokenizers' leftmost-longest.
        pattern = "|".join(re.escape(c) for c in sorted(raw, key=len, reverse=True) if c)
        self._split = re.compile(f"({pattern})") if pattern else None
        self.exact = self._split is not None and self._provably_exact(tokenizer)
        if self.exact:
            agrees = self._probe_agrees(list(raw))
            if not agrees and self._stretches is not None:
                self._stretches = None  # the faster encoder's fault, or the split's: once more
                agrees = self._probe_agrees(list(raw))
            self.exact = agrees
        if not self.exact:
            self._stretches = None  # whole texts go to the tokenizer itself

    def _provably_exact(self, tokenizer: EngineTokenizer) -> bool:
        if getattr(tokenizer, "encode_special_tokens", False):
            return False
        for t in tokenizer.get_added_tokens_decoder().values():
            if not t.normalized and (t.lstrip or t.rstrip or t.single_word):
                return False
        config = json.loads(tokenizer.to_str())
        return not _position_dependent([config.get("normalizer"), config.get("pre_tokenizer")])

    def _probe_agrees(self, tokens: list[str]) -> bool:
        for probe in _PROBES:
            text = probe.join(tokens) + probe + "".join(tokens) + probe[::-1]
            whole = pack_token_ids(
                self._tok.encode(text, add_special_tokens=False).ids
            )  # the reference
            if self._pieces(text, remember=False) != whole:
                return False
        return True

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    @property
    def fast(self) -> bool:
        """Stretches go to a faster encoder than the tokenizer's own."""
        return self._stretches is not None

    def stretch(self, text: str) -> bytes:
        """The packed ids of a stretch (text without added tokens); pure, so safe in a worker
        thread."""
        if self._stretches is not None:
            return pack_token_ids(self._stretches.ids(text))
        return pack_token_ids(token_ids(self._tok, text, add_special_tokens=False))

    def encode(self, text: str) -> bytes:
        if not self.exact:
            return pack_token_ids(token_ids(self._tok, text, add_special_tokens=False))
        return self._pieces(text, remember=True)

    def uncached(self, text: str) -> list[str]:
        """The stretches of ``text`` that ``encode`` would hand the tokenizer now (each
        once, in order); ``[text]`` when not exact (the whole text is encoded each time)."""
        if not self.exact:
            return [text]
        assert self._split is not None
        seen: set[str] = set()
        out = []
        for part in self._split.split(text)[::2]:  # the stretches between added tokens
            if part and part not in self._cache and part not in seen:
                seen.add(part)
                out.append(part)
        return out

    def remember(self, text: str, ids: bytes) -> None:
        """Memoize a stretch tokenized elsewhere (``uncached``'s, as packed ids of
        ``encode(text, add_special_tokens=False)``); ignored when not exact."""
        if self.exact and text not in self._cache:
            self._remember(text, ids)

    def _pieces(self, text: str, *, remember: bool) -> bytes:
        assert self._split is not None
        parts = self._split.split(text)
        out: list[bytes] = []
        append = out.append
        cache = self._cache
        for i, part in enumerate(parts):
            if i % 2:  # the capture group: an added token
                append(self._token_bytes[part])
            elif part:
                ids = cache.get(part) if remember else None
                if ids is None:
                    ids = self.stretch(part)
                    if remember:
                        self._remember(part, ids)
                else:
                    cache.move_to_end(part)
                append(ids)
        return b"".join(out)

    def _remember(self, text: str, ids: bytes) -> None:
        size = len(text) + len(ids)
        if size > self._max_bytes:
            return
        cache = self._cache
        cache[text] = ids
        self._bytes += size
        while self._bytes > self._max_bytes:
            old, old_ids = cache.popitem(last=False)
            self._bytes -= len(old) + len(old_ids)
