"""The most hits a cache of ``lines`` entries could have had on a sequence: Belady's MIN.

Evicting the entry whose next use is farthest away misses least of every demand-paged cache
of that size (Belady 1966; Mattson et al. 1970), so its hits bound every placement and
eviction rule from above. Here an entry is a whole prompt prefix and the cache is a fleet's
per-slot prefix caches (llama.cpp with ``--cache-ram 0``: each slot keeps its last prompt;
instances × slots lines). Any real run has at most that many prefixes resident at once and
needs a request's prefix in the slot it runs in, so its engine-reported hits cannot exceed
these on the same request order (the workload's, which no policy changes: requests are sent
in index order). The bound ignores that two concurrent requests for one prefix may need two
slots, so it is loose where one prompt is very hot.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

_NEVER = 1 << 62


def min_misses_hits(keys: Sequence[Hashable], lines: int) -> list[bool]:
    """Per access: whether Belady's MIN with ``lines`` entries hits. O(n log n)."""
    if lines < 1:
        raise ValueError(f"lines must be >= 1, got {lines}")
    next_use = [_NEVER] * len(keys)
    seen: dict[Hashable, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = seen.get(keys[i], _NEVER)
        seen[keys[i]] = i
    resident: dict[Hashable, int] = {}  # key -> its next use
    farthest: list[tuple[int, int, Hashable]] = []  # (-next use, tie, key); stale ones skipped
    hits = []
    for i, key in enumerate(keys):
        hits.append(key in resident)
        if key not in resident and len(resident) >= lines:
            while True:
                neg, _, victim = heapq.heappop(farthest)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[key] = next_use[i]
        heapq.heappush(farthest, (-next_use[i], i, key))
    return hits
