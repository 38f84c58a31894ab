"""An engine's block hashes -> kvgate's own block keys, from the engine's KV events.

vLLM names its blocks with its own seeded hashes (engine_events.py); kvgate keys requests by
its BLAKE2b chain over token ids (routing/hashing.py). ``EngineKeyMap`` rebuilds kvgate's keys
from each ``BlockStored``'s ``token_ids``, continuing the chain of the event's parent block,
and remembers engine hash -> own keys so that ``BlockRemoved`` removes the right keys.

- Block sizes may differ. Engine 32 / kvgate 16: each engine block yields 2 own keys. Engine
  32 / kvgate 64: an own block spans 2 engine blocks; the first one's tokens are carried into
  the next, and the own key is dropped when *either* engine block goes (each engine block
  keeps every own key whose tokens it holds).
- LoRA adapters and cache salts get a chain root of their own (``namespace_root``), so their
  blocks never match plain prompts. Blocks whose extra keys kvgate cannot see in a request
  (multimodal items, prompt embeddings) are not mapped.
- Only KV cache group 0 (the full-attention group) decides prefix hits; other groups' events
  are ignored and counted.
- ``medium`` is the tier (GPU / CPU -> host / anything else -> the store tier).
- The map is bounded per instance (LRU). Dropping a mapping also removes its own keys from the
  view: the engine may still hold the block, but its removal could no longer be applied, and
  a block kvgate wrongly believes cached (a phantom) misroutes, while a forgotten one only
  costs a missed hit.
- A ``BlockStored`` whose parent is not in the map (the subscriber joined late, the mapping was
  dropped) cannot be chained: it is skipped and counted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from backends.engine_events import (
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
    ExtraKeys,
)
from routing.hashing import BlockHasher
from routing.tokenizer import pack_token_ids
from routing.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

# ~350 bytes a mapping: 128k engine blocks is ~45 MB, 4M tokens at block size 32.
DEFAULT_MAX_BLOCKS = 131_072


@dataclass(slots=True)
class EngineKeyStats:
    stored_blocks: int = 0  # engine blocks mapped
    own_keys: int = 0  # own keys announced in BlockStored events
    unknown_parent: int = 0  # engine blocks skipped: their parent is not in the map
    missing_tokens: int = 0  # engine blocks skipped: the event lacks their token ids
    unsupported_extra_keys: int = 0  # engine blocks skipped: multimodal / embeddings keys
    other_groups: int = 0  # events of KV cache groups other than 0, ignored
    unknown_removed: int = 0  # removed engine hashes that were not in the map
    evicted_mappings: int = 0  # mappings dropped by the size cap (their keys removed)
    spans_lost: int = 0  # own keys not announced: an engine block they span is gone


class _Block:
    """What one engine block means in kvgate's keys, and how to continue its chain."""

    __slots__ = ("carry", "carry_from", "digest", "keys", "tiers")

    def __init__(
        self, digest: bytes, carry: bytes, carry_from: tuple[int, ...], keys: list[int]
    ) -> None:
        self.digest = digest  # own chain digest after the last own block completed so far
        self.carry = carry  # packed tokens after that digest (less than one own block)
        self.carry_from = carry_from  # engine blocks the carried tokens came from
        self.keys = keys  # own keys to remove when this engine block goes
        self.tiers = 0  # bit per Tier that holds it


class EngineKeyMap:
    """One engine instance's block hashes -> kvgate's own keys (not thread-safe)."""

    def __init__(self, hasher: BlockHasher, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.hasher = hasher
        self.max_blocks = max_blocks
        self.stats = EngineKeyStats()
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # last = most recently used

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, engine_hash: object) -> bool:
        return engine_hash in self._blocks

    def keys_of(self, engine_hash: int) -> tuple[int, ...]:
        """The own keys an engine block holds tokens of (``()`` if unknown)."""
        block = self._blocks.get(engine_hash)
        return tuple(block.keys) if block is not None else ()

    def apply(self, events: list[EngineEvent]) -> list[KVEvent]:
        """The events in kvgate's keys, in order (mapping evictions come last)."""
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, EngineBlockStored):
                self._stored(event, out)
            elif isinstance(event, EngineBlockRemoved):
                self._removed(event, out)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()
                out.append(event)
        self._enforce_cap(out)
        return out

    def clear(self) -> None:
        """Forget every mapping (events were lost; the caller clears its view too)."""
        self._blocks.clear()

    # --- BlockStored ------------------------------------------------------------------------

    def _stored(self, ev: EngineBlockStored, out: list[KVEvent]) -> None:
        n = len(ev.block_hashes)
        if ev.group_idx != 0:
            self.stats.other_groups += 1
            return
        size = ev.block_size
        if len(ev.token_ids) < n * size:
            self.stats.missing_tokens += n
            return
        blocks = self._blocks
        if ev.parent_block_hash is None:
            root = self._root(ev)
            if root is None:
                self.stats.unsupported_extra_keys += n
                return
            digest, carry, carry_from = root, b"", ()
        else:
            parent = blocks.get(ev.parent_block_hash)
            if parent is None:
                self.stats.unknown_parent += n
                return
            blocks.move_to_end(ev.parent_block_hash)
            digest, carry, carry_from = parent.digest, parent.carry, parent.carry_from
        packed = pack_token_ids(ev.token_ids[: n * size])
        step, own_step = size * 4, self.hasher.block_size * 4
        tier_bit = 1 << ev.tier
        announced: list[int] = []
        for i, engine_hash in enumerate(ev.block_hashes):
            # Past a prompt's first block only the LoRA name may appear (a salt sits on the
            # first block only); anything else (multimodal items, embeddings) is content a
            # request's keys do not carry, and every later block chains over it.
            if (i > 0 or ev.parent_block_hash is not None) and self._extras(ev, i):
                self.stats.unsupported_extra_keys += n - i
                break
            data = carry + packed[i * step : (i + 1) * step]
            keys, digest = self.hasher.continue_chain(digest, data)
            carry = data[len(keys) * own_step :]
            held = list(keys)
            if keys and carry_from:
                # The first key's block began in earlier engine blocks: all of them hold it.
                spans = [b for h in carry_from if (b := blocks.get(h)) is not None]
                if len(spans) == len(carry_from):
                    for b in spans:
                        if keys[0] not in b.keys:  # (a block stored again: already there)
                            b.keys.append(keys[0])
                else:  # one of them is gone: the engine no longer has that whole own block
                    self.stats.spans_lost += 1
                    held = held[1:]
            carry_from = (engine_hash,) if keys else (*carry_from, engine_hash)
            if not carry:
                carry_from = ()
            block = blocks.get(engine_hash)
            if block is None:
                block = _Block(digest, carry, carry_from, held)
                blocks[engine_hash] = block
                self.stats.stored_blocks += 1
            else:  # stored again (another tier, or a prefix-cache reuse report)
                blocks.move_to_end(engine_hash)
                block.keys.extend(k for k in held if k not in block.keys)
            block.tiers |= tier_bit
            announced.extend(held)
        if announced:
            self.stats.own_keys += len(announced)
            out.append(BlockStored(tuple(announced), ev.tier))

    def _root(self, ev: EngineBlockStored) -> bytes | None:
        """The chain root of a prompt's first block (its LoRA / salt namespace); ``None`` if
        its extra keys hold something a request's keys cannot (multimodal, embeddings)."""
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            lora = f"lora-id:{ev.lora_id}"  # releases before lora_name existed
        salt: str | None = None
        for key in self._extras(ev, 0):
            if not isinstance(key, str) or salt is not None:
                return None
            salt = key
        return self.hasher.namespace_root(lora, salt)

    @staticmethod
    def _extras(ev: EngineBlockStored, i: int) -> tuple[object, ...]:
        """Block ``i``'s extra keys minus the LoRA name (vLLM lists it first when set)."""
        per_block = ev.extra_keys
        keys: ExtraKeys = per_block[i] if per_block is not None and i < len(per_block) else None
        if not keys:
            return ()
        if ev.lora_name is not None and keys[0] == ev.lora_name:
            return keys[1:]
        return keys

    # --- BlockRemoved / the cap -------------------------------------------------------------

    def _removed(self, ev: EngineBlockRemoved, out: list[KVEvent]) -> None:
        if ev.group_idx != 0:
            self.stats.other_groups += 1
            return
        tier = ev.tier
        bit = 1 << tier
        gone: list[int] = []
        for engine_hash in ev.block_hashes:
            block = self._blocks.get(engine_hash)
            if block is None:
                self.stats.unknown_removed += 1
                continue
            gone.extend(block.keys)
            block.tiers &= ~bit
            if not block.tiers:
                del self._blocks[engine_hash]
        if gone:
            out.append(BlockRemoved(tuple(gone), tier))

    def _enforce_cap(self, out: list[KVEvent]) -> None:
        excess = len(self._blocks) - self.max_blocks
        if excess <= 0:
            return
        by_tier: dict[Tier, list[int]] = {}
        for _ in range(excess):
            _, block = self._blocks.popitem(last=False)
            self.stats.evicted_mappings += 1
            for tier in Tier:
                if block.tiers & (1 << tier):
                    by_tier.setdefault(tier, []).extend(block.keys)
        out.extend(BlockRemoved(tuple(keys), tier) for tier, keys in by_tier.items() if keys)
