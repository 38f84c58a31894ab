"""Block-level prefix-cache hit ratios by capacity and eviction policy (Mooncake Table 1).

Requests are replayed in trace order through one global cache of ``capacity`` blocks, as in
the FAST'25 paper's analysis:

1. lookup: the request's hash ids are checked in order and only the *leading run* of cached
   blocks counts as hits. A KV prefix cache can reuse a prefix only: with chained ids a
   cached block after a missing one is useless, since its KV depends on the missing block.
2. update: every block of the request is touched (inserted, or refreshed if present) in
   prompt order; then blocks are evicted until at most ``capacity`` remain. The request's
   own blocks may be evicted too (it held them while it ran).

hit ratio = hits / lookups over all blocks of all requests. With infinite capacity nothing
is evicted and, because a seen chained id implies its whole prefix was seen, the ratio
equals the "blocks seen before" share in ``traces.trace_summary`` (0.366 / 0.640 for the
Mooncake conversation / synthetic traces).

Policies (victim order when over capacity):

* ``lru``: least recently touched first.
* ``lfu``: fewest touches since the block entered the cache first (the count restarts when
  a block is evicted and re-enters), least recently touched among equals.
* ``length_aware``: Mooncake's LengthAwareCache, which the paper describes only as
  prioritising blocks by where they occur in requests: blocks deeper in the request (later
  positions) are evicted first, least recently touched among equal depths. Deep blocks are
  the least shareable (a hit on block k needs blocks 0..k-1 cached too). A block's depth is
  its position in the last request that touched it (fixed under chained semantics).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from replay.workload.traces import TraceError, TraceRequest, load_trace

POLICIES = ("lru", "lfu", "length_aware")
EXIT_USAGE = 2
DEFAULT_CAPACITIES = "inf,100000,50000,30000,10000,1000"  # the paper's Table 1 columns

Blocks = Sequence[tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class CacheResult:
    policy: str
    capacity_blocks: int | None  # None = infinite
    hit_ratio: float  # hits / lookups (0.0 for a trace without blocks)
    hits: int  # blocks found in the leading cached prefix of their request
    lookups: int  # all prompt blocks of all requests


def _leading_hits(ids: tuple[int, ...], cache: Any) -> int:
    k = 0
    for h in ids:
        if h not in cache:
            break
        k += 1
    return k


def _run_infinite(seqs: Blocks) -> int:
    seen: set[int] = set()
    hits = 0
    for ids in seqs:
        hits += _leading_hits(ids, seen)
        seen.update(ids)
    return hits


def _run_lru(seqs: Blocks, capacity: int) -> int:
    cache: OrderedDict[int, None] = OrderedDict()  # oldest first
    hits = 0
    for ids in seqs:
        hits += _leading_hits(ids, cache)
        for h in ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _run_ranked(seqs: Blocks, capacity: int, lfu: bool) -> int:
    """LFU (rank = touch count) or length-aware (rank = -depth); evict lowest rank first.

    Blocks live in one insertion-ordered bucket per rank (oldest touch first), and a heap
    holds the ranks that have a bucket, so a touch and an eviction are O(1) / O(log ranks).
    """
    rank_of: dict[int, int] = {}
    buckets: dict[int, OrderedDict[int, None]] = {}
    ranks: list[int] = []  # heap; a rank is in it exactly when it is a key of ``buckets``
    hits = 0
    for ids in seqs:
        hits += _leading_hits(ids, rank_of)
        for pos, h in enumerate(ids):
            old = rank_of.get(h)
            rank = (1 if old is None else old + 1) if lfu else -pos
            if old is not None:
                if old == rank:
                    buckets[rank].move_to_end(h)
                    continue
                del buckets[old][h]  # an emptied bucket is dropped lazily at eviction
            bucket = buckets.get(rank)
            if bucket is None:
                bucket = buckets[rank] = OrderedDict()
                heapq.heappush(ranks, rank)
            bucket[h] = None
            rank_of[h] = rank
        while len(rank_of) > capacity:
            bucket = buckets[ranks[0]]
            if not bucket:
                del buckets[heapq.heappop(ranks)]
                continue
            victim, _ = bucket.popitem(last=False)
            del rank_of[victim]
    return hits


def simulate(requests: Sequence[TraceRequest], capacity: int | None, policy: str) -> CacheResult:
    """Replay ``requests`` through one cache; see the module docstring for the rules."""
    return analyze(requests, [capacity], [policy])[0]


def analyze(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int | None],
    policies: Sequence[str],
) -> list[CacheResult]:
    """One result per (policy, capacity), policies outer, in the order given."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown cache policy {unknown[0]!r}; known: {', '.join(POLICIES)}")
    bad = [c for c in capacities if c is not None and (isinstance(c, bool) or c < 1)]
    if bad:
        raise ValueError(f"cache capacity must be a positive number of blocks, got {bad[0]!r}")
    seqs = [r.hash_ids for r in requests]
    lookups = sum(len(ids) for ids in seqs)
    distinct = len({h for ids in seqs for h in ids})
    memo: dict[tuple[str, int | None], int] = {}
    results = []
    for policy in policies:
        for cap in capacities:
            # A cache that can hold every distinct block never evicts: policy is moot.
            size = None if cap is None or cap >= distinct else cap
            key = ("inf", None) if size is None else (policy, size)
            if key not in memo:
                if size is None:
                    memo[key] = _run_infinite(seqs)
                elif policy == "lru":
                    memo[key] = _run_lru(seqs, size)
                else:
                    memo[key] = _run_ranked(seqs, size, lfu=policy == "lfu")
            hits = memo[key]
            ratio = hits / lookups if lookups else 0.0
            results.append(CacheResult(policy, cap, ratio, hits, lookups))
    return results


def parse_capacities(text: str) -> list[int | None]:
    """``"1000,10000,50000,inf"`` -> ``[1000, 10000, 50000, None]`` (None = infinite)."""
    out: list[int | None] = []
    for part in text.split(","):
        item = part.strip().lower()
        if item in ("inf", "infinite", "infinity"):
            out.append(None)
            continue
        try:
            cap = int(item)
        except ValueError:
            raise ValueError(
                f"cache capacity {part.strip()!r} is not a whole number of blocks or 'inf'"
            ) from None
        if cap < 1:
            raise ValueError(f"cache capacity must be a positive number of blocks, got {cap}")
        out.append(cap)
    return out


def _label(cap: int | None) -> str:
    return "inf" if cap is None else str(cap)


def format_table(results: Sequence[CacheResult]) -> str:
    """Policies as rows, capacities (blocks) as columns, hit ratios to 3 decimals."""
    caps = list(dict.fromkeys(r.capacity_blocks for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    ratio = {(r.policy, r.capacity_blocks): r.hit_ratio for r in results}
    width = max([len(_label(c)) for c in caps] + [5])
    name_w = max([len(p) for p in policies] + [len("policy")])
    lines = ["policy".ljust(name_w) + "".join(f"  {_label(c):>{width}}" for c in caps)]
    for p in policies:
        cells = "".join(
            f"  {ratio[p, c]:>{width}.3f}" if (p, c) in ratio else "  " + "-".rjust(width)
            for c in caps
        )
        lines.append(p.ljust(name_w) + cells)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``kvgate sim cache``."""
    parser.add_argument("trace", help="Mooncake JSONL trace (hash_ids are needed)")
    parser.add_argument(
        "--capacities",
        default=DEFAULT_CAPACITIES,
        help=f"comma-separated cache sizes in blocks, 'inf' allowed (default {DEFAULT_CAPACITIES})",
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated eviction policies from {', '.join(POLICIES)}",
    )
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Handler of ``kvgate sim cache``: table or JSON on stdout; errors one line, exit 2."""
    try:
        capacities = parse_capacities(args.capacities)
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        if not policies or not capacities:
            raise ValueError("need at least one policy and one capacity")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        requests = load_trace(args.trace)[: args.limit]
        if requests and not any(r.hash_ids for r in requests):
            raise TraceError(args.trace, None, "no hash_ids: this trace has no prefix information")
        results = analyze(requests, capacities, policies)
    except (TraceError, ValueError) as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    lookups = results[0].lookups if results else 0
    if args.json:
        doc = {
            "trace": str(args.trace),
            "requests": len(requests),
            "lookups": lookups,
            "results": [asdict(r) for r in results],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.trace}: {len(requests)} requests, {lookups} block lookups")
        print(format_table(results))
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m replay.sim.cache_analysis")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
