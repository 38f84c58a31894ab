"""Text -> token ids, only as far as the router needs them: to hash a prompt's KV blocks.

The router never decodes, so a tokenizer only has to be deterministic and prefix-stable
(equal text prefixes -> equal token prefixes) for prefix matching to line up with the engine's
cache. ``backends.tokenizer_file.FileTokenizer`` (the engine's own ``tokenizer.json``, read at
the edge) gives exact block boundaries; ``ApproxTokenizer`` needs no files and is exact about
*which* prompts share a prefix, only approximate about *where* the engine's block boundaries
fall.
"""

from __future__ import annotations

import re
import sys
import zlib
from array import array
from collections.abc import Sequence
from itertools import pairwise
from typing import Protocol, runtime_checkable

_TOKEN_MASK = 0x7FFF_FFFF  # ids in [0, 2^31): fit int32 for every packer and engine API
_NOT_ASCII = 0x80  # set in every hashed id; never set in a short ASCII chunk's own id
_NON_ASCII_RUN = re.compile("[^\x00-\x7f]+")
# Non-ASCII runs at most this many ASCII chunks apart are redone as one stretch (cheaper than
# a stretch each); a text with more than one non-ASCII byte per _SPARSE characters is done
# chunk by chunk throughout (finding its runs would cost more than it saves).
_MERGE_GAP = 4
_SPARSE = 32
# array('I') is 32-bit on every platform CPython supports, but check rather than assume.
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (measured faster than struct.pack and numpy)."""
    try:
        packed = array(_UINT32, token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2^32)") from exc
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """The inverse of ``pack_token_ids``."""
    ids = array(_UINT32, data)
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
        ids.byteswap()
    return ids.tolist()


def _chunk_id(chunk: bytes) -> int:
    if len(chunk) <= 4 and chunk.isascii():
        return int.from_bytes(chunk, "little")
    return (zlib.crc32(chunk) & _TOKEN_MASK) | _NOT_ASCII


def _chunk_ids(text: str, first: int, last: int) -> list[int]:
    """The ids of 4-character chunks ``first..last`` (``_chunk_id``, inlined: per request)."""
    crc, from_bytes = zlib.crc32, int.from_bytes
    return [
        from_bytes(b, "little")
        if (b := text[i : i + 4].encode()).isascii()
        else (crc(b) & _TOKEN_MASK) | _NOT_ASCII
        for i in range(4 * first, 4 * last + 4, 4)
    ]


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class ApproxTokenizer:
    """One token per run of ~``chars_per_token`` characters.

    Chunk ``k`` spans characters ``[int(k * cpt), int((k + 1) * cpt))``: boundaries depend only
    on the position, never on the text's length, which is what makes the prefix property hold.
    A chunk of at most 4 ASCII characters is its own id (its bytes read as a little-endian
    integer, < 2^31 because ASCII bytes are < 0x80); any other chunk's id is the CRC-32 of its
    UTF-8 with bit 7 set, so it never equals a short ASCII chunk's. Both are equal across
    processes and Python versions (unlike ``hash()``). With 4 characters per token (the
    default) an ASCII prompt's packed ids are its own bytes, so ``pack`` costs one encode
    instead of a CRC per token: the gateway does this for every request.
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
        packed = self.pack(text)
        if packed is not None:
            return unpack_token_ids(packed)
        chunk_id = _chunk_id
        if self._step:
            c = self._step
            return [chunk_id(text[i : i + c].encode()) for i in range(0, len(text), c)]
        return [chunk_id(text[a:b].encode()) for a, b in pairwise(self._bounds(len(text)))]

    def pack(self, text: str) -> bytes | None:
        """``pack_token_ids(self.encode(text))`` where that is cheap (4 characters per token:
        an ASCII chunk's id is its bytes, so the text's bytes, zero-padded, are the packed ids,
        and only the chunks holding other characters are hashed), else ``None``."""
        if self._step != 4:
            return None
        if text.isascii():
            data = text.encode("ascii")
            return data + bytes(-len(data) % 4)
        if (len(text.encode()) - len(text)) * _SPARSE > len(text):  # dense: chunk by chunk
            return pack_token_ids(_chunk_ids(text, 0, (len(text) - 1) // 4))
        # One byte per character ("?" for the others) keeps every chunk at its offset; each
        # stretch of chunks holding non-ASCII characters gets its ids written over theirs.
        data = text.encode("ascii", "replace")
        ids = array(_UINT32, data + bytes(-len(data) % 4))
        if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
            ids.byteswap()
        first = last = -_MERGE_GAP - 2
        for run in _NON_ASCII_RUN.finditer(text):
            lo, hi = run.start() // 4, (run.end() - 1) // 4
            if lo > last + 1 + _MERGE_GAP:  # far from the chunks so far: write those first
                if first >= 0:
                    ids[first : last + 1] = array(_UINT32, _chunk_ids(text, first, last))
                first = lo
            last = max(last, hi)
        if first >= 0:
            ids[first : last + 1] = array(_UINT32, _chunk_ids(text, first, last))
        if _BIG_ENDIAN:  # pragma: no cover
            ids.byteswap()
        return ids.tobytes()

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


def count_tokens(text: str, tokenizer: Tokenizer) -> int:
    """Token count of ``text`` (through the tokenizer's cheaper ``count_tokens`` if it has one)."""
    counter = getattr(tokenizer, "count_tokens", None)
    if counter is not None:
        return int(counter(text))
    return len(tokenizer.encode(text))
