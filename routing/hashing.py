"""Chained KV block hashes, the keys of the KV index.

Block ``i`` of a prompt is identified by ``h_i = H(h_{i-1} || tokens of block i)`` over *full*
blocks only (a trailing partial block is never cached by the engine, as in vLLM), so equal
hashes mean equal token prefixes and a prompt's hashes are a prefix of any longer prompt's.

Block 0's parent is an all-zero root, or for a LoRA adapter's or a cache salt's blocks a root of
their own (``namespace_root``), so those never match a plain prompt. ``continue_chain`` extends
a chain from any block's digest: how engine KV events, which arrive block run by block run, are
turned into these keys (backends/engine_keys.py).

``H`` is BLAKE2b with an 8-byte digest keyed by the seed: stable across processes, machines and
Python versions (unlike ``hash()``), and the key lets deployments keep hash spaces apart.
Tokens are packed as little-endian uint32; the digest is read little-endian and masked to
63 bits so the ids are non-negative and fit a signed int64 anywhere they are exported.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from routing.tokenizer import Tokenizer, pack_token_ids

HASH_BITS = 63
HASH_MASK = (1 << HASH_BITS) - 1
_ROOT = bytes(8)  # parent of block 0; the seed is already in the key


class BlockHasher:
    """Chained hashes of a token sequence's full ``block_size``-token blocks.

    Digests of recently hashed blocks are remembered (keyed by parent digest + block bytes,
    so a hit is exactly the hash it replaces): prompts that share a prefix, the case prefix
    caching exists for, hash only their new blocks. At most ``memo_blocks`` are kept; when
    full the memo starts over (no LRU bookkeeping on the hot path), ~200 bytes per entry.

    Before that, the last ``chains`` prompts are kept whole, one per first block: a prompt
    whose first block starts one of them shares its hashes up to where the bytes first differ
    (a binary search of slice comparisons, memcmp: ~2 µs for 125 blocks, where a memo hit is
    ~0.2 µs a block). Equal bytes from the same root are the same chain, so those hashes are
    exactly the ones the loop would compute.
    """

    __slots__ = ("_base", "_block_size", "_chains", "_max_chains", "_memo", "_memo_blocks", "_seed")

    def __init__(
        self, block_size: int, seed: int = 0, memo_blocks: int = 32_768, chains: int = 32
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2^64), got {seed}")
        if memo_blocks < 0 or chains < 0:
            raise ValueError(f"memo_blocks and chains must be >= 0, got {memo_blocks}, {chains}")
        self._block_size = block_size
        self._seed = seed
        self._memo: dict[bytes, bytes] = {}
        self._memo_blocks = memo_blocks
        # root + first block -> (packed prompt, its digests, its hashes), least recent first
        self._chains: dict[bytes, tuple[bytes, list[bytes], tuple[int, ...]]] = {}
        self._max_chains = chains
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

    def hash_tokens(self, token_ids: Sequence[int], root: bytes = _ROOT) -> tuple[int, ...]:
        """One hash per full block, in order; ``()`` for fewer than ``block_size`` tokens.
        ``root``: as for ``hash_packed``."""
        n = self.num_blocks(token_ids) * self._block_size
        return self.hash_packed(pack_token_ids(token_ids[:n]), root) if n else ()

    def hash_packed(self, data: bytes, root: bytes = _ROOT) -> tuple[int, ...]:
        """``hash_tokens`` of token ids packed as little-endian uint32 (``pack_token_ids``).

        ``root`` is the chain's parent of block 0: ``namespace_root(...)`` for blocks that
        must never match plain prompts (a LoRA adapter's, a cache salt's). The loop is
        ``continue_chain``'s, inlined: this is the per-request path, and delegating cost ~800
        instructions per call (callgrind)."""
        step = self._block_size * 4
        nbytes = len(data) // step * step
        if not nbytes:
            return ()
        if type(data) is not bytes:  # kept below: a caller's buffer must not change under it
            data = bytes(data)
        head = root + data[:step]
        chains = self._chains
        seen = chains.pop(head, None) if self._max_chains else None
        if seen is not None:  # shares at least its first block with a recent prompt
            k = _common_blocks(data, seen[0], step, min(nbytes, len(seen[0]) // step * step))
            digests = seen[1][:k]
            out = list(seen[2][:k])
            digest = digests[-1]
        else:
            k, digests, out, digest = 0, [], [], root
        copy = self._base.copy
        from_bytes = int.from_bytes
        memo, limit = self._memo, self._memo_blocks
        remembered = memo.get
        append, keep = out.append, digests.append
        for off in range(k * step, nbytes, step):
            key = digest + data[off : off + step]
            digest = remembered(key)  # type: ignore[assignment]
            if digest is None:
                h = copy()
                h.update(key)  # one update: cheaper than two
                digest = h.digest()
                if len(memo) >= limit:
                    memo.clear()
                if limit:
                    memo[key] = digest
            keep(digest)
            append(from_bytes(digest, "little") & HASH_MASK)
        hashes = tuple(out)
        if self._max_chains:
            chains[head] = (data, digests, hashes)
            if len(chains) > self._max_chains:
                del chains[next(iter(chains))]
        return hashes

    def continue_chain(self, parent_digest: bytes, packed: bytes) -> tuple[tuple[int, ...], bytes]:
        """Hash the full blocks of ``packed`` as the continuation of a chain whose last block
        had ``parent_digest``; returns their hashes and the digest to continue from (the
        parent's if ``packed`` holds no full block). Trailing partial-block bytes are ignored:
        the caller carries them into the next call."""
        step = self._block_size * 4
        nbytes = len(packed) // step * step
        copy = self._base.copy
        from_bytes = int.from_bytes
        memo, limit = self._memo, self._memo_blocks
        remembered = memo.get
        out: list[int] = []
        append = out.append
        digest = parent_digest
        for off in range(0, nbytes, step):
            key = digest + packed[off : off + step]
            digest = remembered(key)  # type: ignore[assignment]
            if digest is None:
                h = copy()
                h.update(key)  # one update: cheaper than two
                digest = h.digest()
                if len(memo) >= limit:
                    memo.clear()
                if limit:
                    memo[key] = digest
            append(from_bytes(digest, "little") & HASH_MASK)
        return tuple(out), digest

    def namespace_root(self, lora_name: str | None, cache_salt: str | None) -> bytes:
        """The chain root for blocks computed under a LoRA adapter and/or a cache salt: its
        own hash space, so such blocks never match a plain prompt's (nor each other's). Plain
        blocks (both ``None``) use the ordinary root."""
        if lora_name is None and cache_salt is None:
            return _ROOT
        h = self._base.copy()
        h.update(b"kvgate-namespace\0")  # a tag: no block's input starts like this
        for part in (lora_name, cache_salt):
            if part is None:
                h.update(b"\0")
            else:
                raw = part.encode("utf-8", "surrogatepass")
                h.update(b"\1" + len(raw).to_bytes(4, "little") + raw)
        return h.digest()

    @property
    def root(self) -> bytes:
        """The parent digest of a plain prompt's block 0 (for ``continue_chain``)."""
        return _ROOT

    def hash_text(self, text: str, tokenizer: Tokenizer) -> tuple[tuple[int, ...], int]:
        """``(block hashes, prompt token count)`` of a text prompt (through the tokenizer's
        cheaper ``pack`` where it has one)."""
        pack = getattr(tokenizer, "pack", None)
        packed = pack(text) if pack is not None else None
        if packed is None:
            tokens = tokenizer.encode(text)
            return self.hash_tokens(tokens), len(tokens)
        return self.hash_packed(packed), len(packed) // 4

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self._block_size}, seed={self._seed})"


def _common_blocks(a: bytes, b: bytes, step: int, nbytes: int) -> int:
    """How many whole ``step``-byte blocks ``a`` and ``b`` share from the start, given that
    they share the first and that both hold at least ``nbytes`` bytes."""
    lo, hi = 1, nbytes // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        end = mid * step
        if a[:end] == b[:end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


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


def common_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading blocks ``a`` and ``b`` share. Block keys are chained (above: a key
    equal at position i means equal prompts up to i), so a bisection finds the first
    difference in a few comparisons (placement asks this of every llama.cpp slot for each
    request, routing/llamacpp_slots.py)."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    lo, hi = 1, n - 1  # a[:lo] == b[:lo]; a[hi] != b[hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
