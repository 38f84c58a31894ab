"""Chained KV block hashes, the keys of the KV index.

Block ``i`` of a prompt is identified by ``h_i = H(h_{i-1} || tokens of block i)`` over *full*
blocks only (a trailing partial block is never cached by the engine, as in vLLM), so equal
hashes mean equal token prefixes and a prompt's hashes are a prefix of any longer prompt's.

``H`` is BLAKE2b with an 8-byte digest keyed by the seed: stable across processes, machines and
Python versions (unlike ``hash()``), and the key lets deployments keep hash spaces apart.
Tokens are packed as little-endian uint32; the digest is read little-endian and masked to
63 bits so the ids are non-negative and fit a signed int64 anywhere they are exported.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

from routing.tokenizer import Tokenizer

HASH_BITS = 63
HASH_MASK = (1 << HASH_BITS) - 1
_ROOT = bytes(8)  # parent of block 0; the seed is already in the key
# array('I') is 32-bit on every platform CPython supports, but check rather than assume.
_UINT32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


def _pack_u32(token_ids: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32 bytes (measured faster than struct.pack and numpy)."""
    try:
        packed = array(_UINT32, token_ids)
    except OverflowError as exc:
        raise ValueError("token ids must be in [0, 2^32)") from exc
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Chained hashes of a token sequence's full ``block_size``-token blocks."""

    __slots__ = ("_base", "_block_size", "_seed")

    def __init__(self, block_size: int, seed: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2^64), got {seed}")
        self._block_size = block_size
        self._seed = seed
        # Keyed BLAKE2b spends one compression on the key block; copying a pre-keyed state
        # instead of re-keying per block makes hashing ~30% faster.
        self._base = hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little"))

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def seed(self) -> int:
        return self._seed

    def num_blocks(self, token_ids: Sequence[int] | int) -> int:
        """Full blocks in a token sequence (or in a token count)."""
        n = token_ids if isinstance(token_ids, int) else len(token_ids)
        return n // self._block_size

    def hash_tokens(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """One hash per full block, in order; ``()`` for fewer than ``block_size`` tokens."""
        nbytes = self.num_blocks(token_ids) * self._block_size * 4
        if not nbytes:
            return ()
        data = _pack_u32(token_ids[: nbytes // 4])
        step = self._block_size * 4
        copy = self._base.copy
        from_bytes = int.from_bytes
        out: list[int] = []
        append = out.append
        parent = _ROOT
        for off in range(0, nbytes, step):
            h = copy()
            h.update(parent + data[off : off + step])  # one update: cheaper than two
            parent = h.digest()
            append(from_bytes(parent, "little") & HASH_MASK)
        return tuple(out)

    def hash_text(self, text: str, tokenizer: Tokenizer) -> tuple[tuple[int, ...], int]:
        """``(block hashes, prompt token count)`` of a text prompt."""
        tokens = tokenizer.encode(text)
        return self.hash_tokens(tokens), len(tokens)

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self._block_size}, seed={self._seed})"


def hash_ids_to_blocks(hash_ids: Sequence[int]) -> tuple[int, ...]:
    """Block hashes for a Mooncake-style trace whose ``hash_ids`` are already chained ids.

    Trace ids already identify a whole prefix (id ``k`` at position ``i`` implies the same ids
    before it), so no re-chaining is needed: the mapping is the identity masked to 63 bits,
    which is collision-free for the non-negative ids traces use and keeps ids readable in logs.
    Such ids live in a different space than ``BlockHasher`` hashes of real tokens; a run uses
    one or the other, never both. (Live replay instead turns ids into tokens with
    ``block_tokens_for_id`` and hashes those.)
    """
    return tuple(int(h) & HASH_MASK for h in hash_ids)


_DIGEST_WORDS = struct.Struct("<16I")  # a 64-byte BLAKE2b digest = 16 uint32 words
_U64 = (1 << 64) - 1


def block_tokens_for_id(
    hash_id: int, block_size: int, vocab: int = 32000, seed: int = 0
) -> list[int]:
    """A fixed pseudo-random block of ``block_size`` token ids in ``[0, vocab)`` for a trace id.

    Live replay concatenates these per ``hash_id`` so that traces sharing ids send prompts that
    share token prefixes. BLAKE2b in counter mode rather than ``random``: only ``random()`` is
    guaranteed stable across Python versions, and this is just as fast.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 1 <= vocab <= 1 << 32:
        raise ValueError(f"vocab must be in [1, 2^32], got {vocab}")
    key = (seed & _U64).to_bytes(8, "little")
    ident = (hash_id & _U64).to_bytes(8, "little")
    out: list[int] = []
    counter = 0
    while len(out) < block_size:
        digest = hashlib.blake2b(
            ident + counter.to_bytes(8, "little"), digest_size=64, key=key, person=b"kvgate-tokens"
        ).digest()
        # Modulo bias is < vocab / 2^32 (< 1e-5 for 32k vocab): irrelevant for synthetic text.
        out.extend(w % vocab for w in _DIGEST_WORDS.unpack(digest))
        counter += 1
    del out[block_size:]
    return out
