from __future__ import annotations

import pytest

from replay.engine.prefix_cache import PrefixCache
from routing.types import BlockRemoved, BlockStored


def test_longest_prefix_and_lru_capacity() -> None:
    c = PrefixCache(4)
    c.insert((1, 2, 3))
    assert c.match((1, 2, 9)) == 2
    assert c.drain_events() == [BlockStored((1, 2, 3))]
    c.insert((1, 5, 6))  # 1 touched; 5, 6 new -> 5 blocks > 4: evict LRU = 3? no: 2 was
    # touched by match after 3? Order of use: 3 (insert), 1, 2 (match), 1, 5, 6 (insert)
    assert len(c) == 4
    assert 3 not in c and {1, 2, 5, 6} <= {b for b in (1, 2, 5, 6) if b in c}
    assert c.drain_events() == [BlockStored((5, 6)), BlockRemoved((3,))]


def test_never_evicts_the_prompt_being_inserted() -> None:
    c = PrefixCache(2)
    c.insert((1, 2, 3))  # longer than capacity: keeps all of it for now
    assert all(b in c for b in (1, 2, 3))
    c.insert((4,))
    assert len(c) == 2 and 4 in c


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixCache(0)
