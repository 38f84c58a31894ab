"""Belady's MIN (bench/cache_bounds.py) against a brute force over every eviction choice."""

from __future__ import annotations

import itertools
import random

import pytest

from bench.cache_bounds import min_misses_hits


def _best_hits(keys: list[int], lines: int) -> int:
    """The most hits any demand-paged cache of ``lines`` entries gets (exhaustive)."""
    best = 0

    def walk(i: int, cache: frozenset[int], hits: int) -> None:
        nonlocal best
        if i == len(keys):
            best = max(best, hits)
            return
        k = keys[i]
        if k in cache:
            walk(i + 1, cache, hits + 1)
        elif len(cache) < lines:
            walk(i + 1, cache | {k}, hits)
        else:
            for victim in cache:
                walk(i + 1, (cache - {victim}) | {k}, hits)

    walk(0, frozenset(), 0)
    return best


def test_min_is_optimal_on_small_random_sequences() -> None:
    rng = random.Random(7)
    for _ in range(60):
        keys = [rng.randrange(5) for _ in range(rng.randint(1, 11))]
        for lines in (1, 2, 3):
            assert sum(min_misses_hits(keys, lines)) == _best_hits(keys, lines), (keys, lines)


def test_min_hits_every_repeat_when_everything_fits_and_refuses_no_room() -> None:
    keys = [k for k, _ in itertools.product(range(4), range(3))]
    assert min_misses_hits(keys, 4) == [i % 3 != 0 for i in range(12)]
    assert sum(min_misses_hits([0, 1, 2, 0, 1, 2], 2)) == 2  # LRU would hit none
    with pytest.raises(ValueError):
        min_misses_hits([1], 0)
