"""Token ids of recently seen prompt prefixes, found by block hash: what a warm-up copy sends.

A ``ReplicationCommand`` names its prefix by kvgate's block hashes (``prefix_key`` = the hash of
its last block). An engine without a KV-copy API can only be given the prefix by prefilling its
tokens (backends/warmup_sink.py), so the gateway keeps the token ids of prompts it has seen.
Block hashes chain (routing/hashing.py): one hash stands for exactly one token prefix, so every
full-block hash of a remembered prompt points at that prompt's entry, and a lookup cuts the
entry's tokens at the hash's block.

Bounded in bytes, LRU by entry. A prompt lying wholly inside a kept entry only refreshes it; a
prompt that extends an entry (the next turn of a chat) replaces it, so a conversation costs one
entry, not one per turn. Only token ids the engine itself would see are worth keeping: those of
an engine-exact encoder, or a token-id prompt sent as it is (``remember_request``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from routing.prompt import PromptError
from routing.prompt_encoder import CHAT_PATH, PromptTokens, completion_prompt
from routing.tokenizer import unpack_token_ids

_TOKEN_BYTES = 4  # packed ids are uint32
# Bytes charged per block besides its tokens: the hash map's slot, the hash int and the tuple
# slot that keep it findable (CPython, measured with tracemalloc: ~110-120 bytes).
_BLOCK_OVERHEAD = 120
_ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class PrefixTokens:
    """One prefix as a warm-up request sends it."""

    packed: bytes  # token ids, little-endian uint32 (routing.tokenizer.pack_token_ids)
    model: str | None  # the ``model`` field of the request it came from
    cache_salt: str | None  # vLLM's cache namespace: the warm-up must carry it to hit the same
    block_hashes: tuple[int, ...] = ()  # kvgate's keys of the prefix's blocks, from the first

    @property
    def n_tokens(self) -> int:
        return len(self.packed) // _TOKEN_BYTES

    def token_ids(self) -> list[int]:
        return unpack_token_ids(self.packed)


@dataclass(slots=True, eq=False)
class _Entry:
    seq: int
    hashes: tuple[int, ...]  # the prompt's full-block hashes
    packed: bytes  # tokens of those blocks only
    model: str | None
    cache_salt: str | None
    cost: int


class PrefixTokenStore:
    """Block hash -> the token prefix it stands for, for recently seen prompts (LRU, bounded)."""

    def __init__(self, block_size: int, max_bytes: int = 64 << 20) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.block_size = block_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU first
        self._by_hash: dict[int, _Entry] = {}
        self._bytes = 0
        self._seq = 0
        self.evicted = 0

    @property
    def bytes(self) -> int:
        """Bytes charged to the kept entries (tokens plus bookkeeping), <= ``max_bytes``."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._by_hash

    def remember(
        self,
        block_hashes: Sequence[int],
        packed: bytes,
        *,
        model: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Keep a prompt: its full-block hashes and its packed token ids (a trailing partial
        block, which no engine caches, is dropped)."""
        hashes = tuple(block_hashes)
        if not hashes:
            return
        need = len(hashes) * self.block_size * _TOKEN_BYTES
        if len(packed) < need:
            raise ValueError(
                f"{len(hashes)} blocks of {self.block_size} tokens need {need} bytes of "
                f"packed ids, got {len(packed)}"
            )
        by_hash = self._by_hash
        owner = by_hash.get(hashes[-1])
        if owner is not None:  # the whole prompt is a prefix of a kept one (hashes chain)
            self._entries.move_to_end(owner.seq)
            return
        cost = _ENTRY_OVERHEAD + need + len(hashes) * _BLOCK_OVERHEAD
        if cost > self.max_bytes:
            return
        previous = {e for e in map(by_hash.get, hashes) if e is not None}
        self._seq += 1
        entry = _Entry(self._seq, hashes, packed[:need], model, cache_salt, cost)
        by_hash.update(zip(hashes, repeat(entry)))
        self._entries[entry.seq] = entry
        self._bytes += cost
        for old in previous:
            # Its last block now points here: by the chain, so do all of its blocks.
            if by_hash.get(old.hashes[-1]) is entry:
                self._entries.pop(old.seq, None)
                self._bytes -= old.cost
        while self._bytes > self.max_bytes:
            self._evict_oldest()

    def remember_request(
        self,
        path: str,
        body: Mapping[str, Any],
        block_hashes: Sequence[int],
        tokens: PromptTokens,
        exact: bool,
    ) -> bool:
        """Keep a parsed request's prompt (``tokens``, as the gateway encoded it) if its token
        ids are the engine's: ``exact`` (an engine-exact encoder), or a completion whose prompt
        is token ids. Returns whether it was kept."""
        if not block_hashes:
            return False
        try:
            if not exact and (path == CHAT_PATH or isinstance(completion_prompt(body), str)):
                return False  # approximate ids: a warm-up with them would cache nothing useful
        except PromptError:
            return False
        model = body.get("model")
        self.remember(
            block_hashes,
            tokens.packed,
            model=model if isinstance(model, str) else None,
            cache_salt=tokens.cache_salt,
        )
        return True

    def lookup(self, block_hash: int) -> PrefixTokens | None:
        """The token prefix ending with the block ``block_hash``; None if not remembered."""
        entry = self._by_hash.get(block_hash)
        if entry is None:
            return None
        self._entries.move_to_end(entry.seq)
        n_blocks = entry.hashes.index(block_hash) + 1
        end = n_blocks * self.block_size * _TOKEN_BYTES
        hashes = tuple(entry.hashes[:n_blocks])
        return PrefixTokens(entry.packed[:end], entry.model, entry.cache_salt, hashes)

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.cost
        self.evicted += 1
        by_hash = self._by_hash
        for h in entry.hashes:
            if by_hash.get(h) is entry:  # a newer prompt may have taken the shared blocks
                del by_hash[h]
