"""Text -> token ids, only as far as the router needs them: to hash a prompt's KV blocks.

The router never decodes, so a tokenizer only has to be deterministic and prefix-stable
(equal text prefixes -> equal token prefixes) for prefix matching to line up with the engine's
cache. ``FileTokenizer`` (the engine's own ``tokenizer.json``) gives exact block boundaries;
``ApproxTokenizer`` needs no files and is exact about *which* prompts share a prefix, only
approximate about *where* the engine's block boundaries fall.
"""

from __future__ import annotations

import zlib
from itertools import pairwise
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

_TOKEN_MASK = 0x7FFF_FFFF  # ids in [0, 2^31): fit int32 for every packer and engine API


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ApproxTokenizer:
    """One token per run of ~``chars_per_token`` characters, id = CRC-32 of the run's UTF-8.

    Chunk ``k`` spans characters ``[int(k * cpt), int((k + 1) * cpt))``: boundaries depend only
    on the position, never on the text's length, which is what makes the prefix property hold.
    CRC-32 (not ``hash()``) so that ids are equal across processes and Python versions.
    """

    __slots__ = ("_chars_per_token", "_step")

    def __init__(self, chars_per_token: float = 4.0) -> None:
        if not chars_per_token >= 1.0:  # also rejects NaN
            raise ValueError(f"chars_per_token must be >= 1, got {chars_per_token!r}")
        self._chars_per_token = float(chars_per_token)
        # Integral ratios take the fast path (a plain range stride, no float boundaries).
        self._step = int(chars_per_token) if float(chars_per_token).is_integer() else 0

    @property
    def chars_per_token(self) -> float:
        return self._chars_per_token

    def encode(self, text: str) -> list[int]:
        crc = zlib.crc32
        n = len(text)
        if self._step:
            c = self._step
            return [crc(text[i : i + c].encode()) & _TOKEN_MASK for i in range(0, n, c)]
        bounds = self._bounds(n)
        return [crc(text[a:b].encode()) & _TOKEN_MASK for a, b in pairwise(bounds)]

    def count_tokens(self, text: str) -> int:
        if self._step:
            return -(-len(text) // self._step)
        return len(self._bounds(len(text))) - 1

    def _bounds(self, n: int) -> list[int]:
        """Chunk boundaries 0 = b0 < b1 < ... < bk = n for a non-integral ratio ([0] if n == 0)."""
        cpt = self._chars_per_token
        bounds = [int(k * cpt) for k in range(int(n // cpt) + 2)]
        # Trim boundaries at or past the end (float rounding may put one exactly on n), then
        # close the last, possibly partial, chunk at n.
        while bounds and bounds[-1] >= n:
            bounds.pop()
        bounds.append(n)
        return bounds

    def __repr__(self) -> str:
        return f"ApproxTokenizer(chars_per_token={self._chars_per_token})"


class FileTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json``.

    Encodes without special tokens: the chat template / BOS handling belongs to the engine, and
    adding them here would shift every block boundary relative to what the engine caches.
    """

    __slots__ = ("_path", "_tok")

    def __init__(self, path: str | Path) -> None:
        try:
            # Lazy: the package is an optional extra (kvgate[tokenizer]).
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "routing.tokenizer_file needs the 'tokenizers' package: "
                "pip install 'kvgate[tokenizer]' (or unset tokenizer_file to use the "
                "approximate tokenizer)"
            ) from exc
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        try:
            self._tok: Any = HFTokenizer.from_file(str(p))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON / models
            raise ValueError(f"cannot load tokenizer file {p}: {exc}") from exc
        self._path = p

    @property
    def path(self) -> Path:
        return self._path

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        return ids

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def __repr__(self) -> str:
        return f"FileTokenizer({str(self._path)!r})"


def load_tokenizer(path: str | None, chars_per_token: float = 4.0) -> Tokenizer:
    """The tokenizer ``RoutingSettings`` asks for: the file if set, else the approximation."""
    if path:
        return FileTokenizer(path)
    return ApproxTokenizer(chars_per_token)


def count_tokens(text: str, tokenizer: Tokenizer) -> int:
    """Token count of ``text`` (through the tokenizer's cheaper ``count_tokens`` if it has one)."""
    counter = getattr(tokenizer, "count_tokens", None)
    if counter is not None:
        return int(counter(text))
    return len(tokenizer.encode(text))
