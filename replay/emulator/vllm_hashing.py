"""vLLM's own prefix-cache block hashes, so the emulator's KV events carry what vLLM's carry.

vLLM 0.32 (``v1/core/kv_cache_utils.py`` ``hash_block_tokens``, ``utils/hashing.py``
``sha256``; the default ``--prefix-caching-hash-algo sha256``): a block's hash is
``sha256(pickle.dumps((parent_digest, tuple(block_token_ids), extra_keys), protocol=5))``,
the first block's parent is ``NONE_HASH = sha256(pickle.dumps("vllm-none-hash"))`` (or of
``PYTHONHASHSEED`` when that is set), and events carry the digest's last 8 bytes as an
unsigned 64-bit int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default). Chaining needs the
whole 32-byte digests, so ``VllmBlockHashes`` keeps them for the blocks the emulator holds.

``extra_keys`` (``generate_block_hash_extra_keys``) are tagged in the hash: a LoRA adapter's
``("lora", name, path)`` on every block, a cache salt's ``("cache_salt", salt)`` on a prompt's
first block only, the LoRA key first; events publish them untagged (``to_event_extra_keys``:
the name, the salt).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on the Pythons vLLM 0.32 supports


def sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=_PICKLE_PROTOCOL)).digest()


def none_hash(seed: str = DEFAULT_NONE_HASH_SEED) -> bytes:
    """The parent digest of a prompt's first block."""
    return sha256_pickle(seed)


def block_digest(
    parent: bytes, token_ids: Sequence[int], extra_keys: tuple[object, ...] | None = None
) -> bytes:
    return sha256_pickle((parent, tuple(token_ids), extra_keys))


@dataclass(frozen=True, slots=True)
class BlockNamespace:
    """What vLLM mixes into a block's hash besides its tokens (None: a plain prompt)."""

    lora_name: str | None = None
    lora_path: str | None = None  # the adapter's path as vLLM was given it (hashed with it)
    lora_id: int | None = None  # vLLM's int id of the adapter (1, 2, ... in load order)
    cache_salt: str | None = None

    def hash_keys(self, block_index: int) -> tuple[tuple[str, ...], ...] | None:
        """Block ``block_index``'s tagged extra keys, as vLLM hashes them."""
        keys: list[tuple[str, ...]] = []
        if self.lora_name is not None:
            keys.append(("lora", self.lora_name, self.lora_path or self.lora_name))
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) or None

    def event_keys(self, block_index: int) -> list[str] | None:
        """The same keys untagged, as vLLM's events carry them."""
        keys = self.hash_keys(block_index)
        return None if keys is None else [k[1] for k in keys]


PLAIN = BlockNamespace()


def external_hash(digest: bytes) -> int:
    """What a KV event carries for a digest: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


class VllmBlockHashes:
    """vLLM digests of the blocks an emulated instance holds, by the emulator's own block key.

    The emulator's engine model keys blocks by kvgate's hashes; its events must name them the
    way vLLM would. Entries live while the block is cached (``forget`` on removal). The tokens
    of each block are kept too: a copy of a block to another instance carries them, as a real
    KV transfer's destination knows the tokens of what it loaded.
    """

    def __init__(self, block_size: int, seed: str = DEFAULT_NONE_HASH_SEED) -> None:
        self.block_size = block_size
        self.root = none_hash(seed)
        self._digests: dict[int, bytes] = {}
        self._tokens: dict[int, tuple[int, ...]] = {}
        self._spaces: dict[int, BlockNamespace] = {}  # only blocks outside the plain space

    def __len__(self) -> int:
        return len(self._digests)

    def get(self, key: int) -> bytes | None:
        return self._digests.get(key)

    def chain(
        self,
        keys: Sequence[int],
        token_ids: Sequence[int],
        parent_key: int | None,
        prompt_tokens: Sequence[int] | None = None,
        start_block: int = 0,
        space: BlockNamespace = PLAIN,
    ) -> tuple[bytes | None, list[bytes]]:
        """The parent's digest (None for a prompt's first block) and the digests of blocks
        ``keys`` with ``token_ids`` after ``parent_key``'s block, in namespace ``space``. When
        the parent's digest is not known, it is rebuilt from ``prompt_tokens`` (whose block
        ``start_block`` the run starts at)."""
        parent = (
            None
            if parent_key is None
            else self._parent(parent_key, prompt_tokens, start_block, space)
        )
        digest = self.root if parent is None else parent
        size = self.block_size
        out: list[bytes] = []
        for i, key in enumerate(keys):
            block = tuple(token_ids[i * size : (i + 1) * size])
            digest = block_digest(digest, block, space.hash_keys(start_block + i))
            self._digests[key] = digest
            self._tokens[key] = block
            if space != PLAIN:
                self._spaces[key] = space
            out.append(digest)
        return parent, out

    def tokens_of(self, keys: Sequence[int]) -> list[int] | None:
        """The token ids of blocks ``keys``, or None unless every one of them is known."""
        out: list[int] = []
        for key in keys:
            block = self._tokens.get(key)
            if block is None:
                return None
            out.extend(block)
        return out

    def space_of(self, keys: Sequence[int]) -> BlockNamespace | None:
        """The namespace blocks ``keys`` were hashed in; None if they were not all in one."""
        spaces = {self._spaces.get(key, PLAIN) for key in keys}
        return spaces.pop() if len(spaces) == 1 else None

    def stand_in(self, key: int) -> bytes:
        """Remember a block whose tokens the emulator does not know (a fetched copy)."""
        return self._digests.setdefault(key, stand_in_digest(key))

    def forget(self, key: int) -> bytes:
        """The block left the cache: its digest (for the removal event), now forgotten."""
        self._tokens.pop(key, None)
        self._spaces.pop(key, None)
        digest = self._digests.pop(key, None)
        return digest if digest is not None else stand_in_digest(key)

    def clear(self) -> None:
        self._digests.clear()
        self._tokens.clear()
        self._spaces.clear()

    def _parent(
        self,
        parent_key: int,
        prompt_tokens: Sequence[int] | None,
        start_block: int,
        space: BlockNamespace,
    ) -> bytes:
        known = self._digests.get(parent_key)
        if known is not None:
            return known
        digest = self.root
        if prompt_tokens is None or len(prompt_tokens) < start_block * self.block_size:
            return stand_in_digest(parent_key)  # nothing better: the chain is unknown
        size = self.block_size
        for b in range(start_block):
            digest = block_digest(
                digest, prompt_tokens[b * size : (b + 1) * size], space.hash_keys(b)
            )
        return digest


def stand_in_digest(key: int) -> bytes:
    """A digest for an emulator block whose tokens are unknown: not a hash of tokens, so no
    real vLLM block has it and nothing matches it by accident."""
    return hashlib.sha256(b"kvgate-emulator-no-tokens" + key.to_bytes(8, "big")).digest()
