"""Decoding ``KVIndex.match``'s drop points into every instance's cached prefix.

``match`` walks a prompt's blocks once with an ``alive`` mask (``alive &= holders``); when a bit
drops out at block ``i`` that holder's prefix is ``i`` blocks (routing/kv_index.py). Each drop
point is (bits that dropped, prefix length); this module turns those into a ``PrefixMatch``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from routing.kv_holdings import K_BOTH, K_GPU, K_LOCAL, K_STORE
from routing.types import PrefixMatch

Owner = Mapping[int, tuple[str, int]]  # one slot's bits (or the store bit) -> (id, K_* kind)


def decode_drops(
    drops: list[tuple[int, int]],
    owner: Owner,
    slot_masks: list[int],
    order: Callable[[str], int],
) -> PrefixMatch:
    """Decode the drop points into per-instance prefix lengths.

    A point where a single instance drops out (its GPU bit, local bit or both) decodes with
    one dict lookup; coincident drops are split. Dicts fill in increasing prefix length
    (each id once), so the best holders are the tail of ``local_blocks``; ties among them
    go by registration ``order``.
    """
    lookup = owner.get
    gpu_blocks: dict[str, int] = {}
    local_blocks: dict[str, int] = {}
    store = 0
    for bits, length in drops:
        entry = lookup(bits)
        if entry is not None and entry[1] == K_BOTH:  # the common case, kept inline
            gpu_blocks[entry[0]] = local_blocks[entry[0]] = length
            continue
        for iid, kind in (entry,) if entry is not None else split_bits(bits, owner, slot_masks):
            if kind == K_STORE:
                store = length
                continue
            if kind & K_GPU:
                gpu_blocks[iid] = length
            if kind & K_LOCAL:
                local_blocks[iid] = length
    if not local_blocks:
        return PrefixMatch(gpu_blocks, local_blocks, store, 0, ())
    best = next(reversed(local_blocks.values()))
    holders = []
    for iid in reversed(local_blocks):
        if local_blocks[iid] != best:
            break
        holders.append(iid)
    if len(holders) > 1:  # several dropped at one point: registration order
        holders.sort(key=order)
    return PrefixMatch(gpu_blocks, local_blocks, store, best, tuple(holders))


def split_bits(bits: int, owner: Owner, slot_masks: list[int]) -> list[tuple[str, int]]:
    """(instance id, kind) of every slot with a bit in ``bits``, peeled from the top."""
    parts: list[tuple[str, int]] = []
    while bits:
        part = bits & slot_masks[(bits.bit_length() - 1) >> 1]
        bits ^= part
        parts.append(owner[part])
    return parts
