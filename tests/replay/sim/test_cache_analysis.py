"""Prefix-cache hit ratios by policy and capacity (``replay.sim.cache_analysis``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from replay.sim.cache_analysis import (
    POLICIES,
    CacheResult,
    add_arguments,
    analyze,
    format_table,
    main,
    parse_capacities,
    simulate,
)
from replay.workload.synthetic import SyntheticSpec, generate, write_mooncake
from replay.workload.traces import TraceRequest, blocks_seen_before
from tests.replay.workload.test_traces import real_trace


def trace(*blocks: tuple[int, ...]) -> list[TraceRequest]:
    return [TraceRequest(i, float(i), 512 * len(b), 1, b) for i, b in enumerate(blocks)]


# Capacity 3. Walk-through (cache contents after each request):
#   1 [1,2,3] all miss                     LRU {1,2,3}   LFU {1,2,3}x1   LA {1,2,3}
#   2 [1,2,3] 3 hits                       LRU {1,2,3}   LFU {1,2,3}x2   LA {1,2,3}
#   3 [4] miss, one block over:            LRU drops 1   LFU drops 4     LA drops 3 (deepest)
#   4 [1,2,3] LRU: 1 missing -> 0 hits although 2 and 3 are cached; LFU 3 hits;
#     LA 2 hits (1, 2), 3 re-inserted and dropped again (deepest)
#                                          LRU {1,2,3}   LFU {1,2,3}x3   LA {1,2,4}
#   5 [4] LRU miss (drops 1), LFU miss (drops 4), LA 1 hit
#   6 [1,2,3] LRU 0 hits, LFU 3, LA 2
# Infinite: 0 + 3 + 0 + 3 + 1 + 3 = 10 of 14.
HAND = trace((1, 2, 3), (1, 2, 3), (4,), (1, 2, 3), (4,), (1, 2, 3))
HAND_HITS = {"lru": 3, "lfu": 9, "length_aware": 8}


@pytest.mark.parametrize("policy", POLICIES)
def test_hand_example(policy: str) -> None:
    got = simulate(HAND, 3, policy)
    assert got == CacheResult(policy, 3, HAND_HITS[policy] / 14, HAND_HITS[policy], 14)
    assert simulate(HAND, None, policy).hits == 10
    assert simulate(HAND, 4, policy).hits == 10  # holds every distinct block: no eviction


def test_only_the_leading_cached_run_counts() -> None:
    # After [1,2] and [3] with room for 2, LRU holds {2,3}: block 2 is cached but its
    # prefix (block 1) is not, so it cannot be reused.
    reqs = trace((1, 2), (3,), (1, 2))
    assert simulate(reqs, 2, "lru").hits == 0
    assert simulate(reqs, 3, "lru").hits == 2


def test_lfu_breaks_ties_by_recency() -> None:
    # All blocks touched once; the least recently touched (5) goes first.
    reqs = trace((5,), (6,), (7,), (6,), (5,))
    # Capacity 2: after (7,) evict 5 -> {6,7}; (6,) hit -> 6 has 2; (5,) miss.
    assert simulate(reqs, 2, "lfu").hits == 1


def test_length_aware_keeps_shallow_blocks_over_recent_deep_ones() -> None:
    reqs = trace((1, 2), (3, 4), (1,), (3, 4))
    # Capacity 3: after (3,4) the deepest, oldest block (2) goes -> {1,3,4}; then (1,) hit;
    # (3,4) 2 hits. LRU drops 1 after (3,4) -> (1,) miss, drops 2 -> (3,4) hits 2.
    assert simulate(reqs, 3, "length_aware").hits == 3
    assert simulate(reqs, 3, "lru").hits == 2


def test_infinite_capacity_equals_blocks_seen_before() -> None:
    reqs = generate(
        SyntheticSpec(requests=800, families=5, family_fraction=0.7, followup_prob=0.4, seed=9)
    )
    seen, total = blocks_seen_before(reqs)
    for r in analyze(reqs, [None], POLICIES):
        assert (r.hits, r.lookups) == (seen, total)


def test_results_order_and_validation() -> None:
    res = analyze(HAND, [3, None], ["lfu", "lru"])
    assert [(r.policy, r.capacity_blocks) for r in res] == [
        ("lfu", 3),
        ("lfu", None),
        ("lru", 3),
        ("lru", None),
    ]
    with pytest.raises(ValueError, match="unknown cache policy 'fifo'; known: lru, lfu, length_"):
        analyze(HAND, [3], ["fifo"])
    with pytest.raises(ValueError, match="positive number of blocks"):
        analyze(HAND, [0], ["lru"])
    assert analyze([], [10], ["lru"]) == [CacheResult("lru", 10, 0.0, 0, 0)]


def test_parse_capacities() -> None:
    assert parse_capacities("1000, 10_000,50000,inf,INF") == [1000, 10000, 50000, None, None]
    for bad, message in [
        ("0", "positive"),
        ("-5", "positive"),
        ("1e4", "whole number"),
        ("", "whole number"),
        ("1000,,inf", "whole number"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_capacities(bad)


def test_format_table() -> None:
    table = format_table(analyze(HAND, [None, 3], ["lru", "length_aware"]))
    assert table.splitlines() == [
        "policy          inf      3",
        "lru           0.714  0.214",
        "length_aware  0.714  0.571",
    ]


def test_real_trace_lru_monotone_in_capacity() -> None:
    reqs = real_trace("conversation_trace.jsonl")
    caps: list[int | None] = [1000, 5000, 10000, 30000, 50000, 100000, None]
    res = analyze(reqs, caps, POLICIES)
    lru = [r.hit_ratio for r in res if r.policy == "lru"]
    assert lru == sorted(lru)
    assert lru[-1] == pytest.approx(0.366, abs=0.001)
    by = {(r.policy, r.capacity_blocks): r.hit_ratio for r in res}
    assert by["lru", None] == by["lfu", None] == by["length_aware", None]
    # Paper's ordering at mid capacities: LRU >= LFU >= LengthAware.
    assert by["lru", 30000] >= by["lfu", 30000] >= by["length_aware", 30000]


# ------------------------------------------------------------------------------------ CLI


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return main(parser.parse_args(argv))


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.jsonl"
    write_mooncake(generate(SyntheticSpec(requests=200, families=3, family_fraction=0.8)), path)
    return path


def test_cli_table_and_json(small_trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([str(small_trace), "--capacities", "50,inf", "--policies", "lru,lfu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{small_trace}: 200 requests, ")
    assert out[1].split() == ["policy", "50", "inf"]
    assert [line.split()[0] for line in out[2:]] == ["lru", "lfu"]

    assert run([str(small_trace), "--capacities", "inf", "--json", "--limit", "100"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 100
    assert [r["policy"] for r in doc["results"]] == list(POLICIES)
    assert {r["capacity_blocks"] for r in doc["results"]} == {None}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{trace}", "--capacities", "lots"], "not a whole number"),
        (["{trace}", "--policies", "lru,fifo"], "unknown cache policy 'fifo'"),
        (["{trace}", "--limit", "0"], "--limit must be >= 1"),
        (["{missing}"], "no such file"),
        (["{csv}"], "no hash_ids"),
        (["{bad}"], ":2: missing key 'input_length'"),
    ],
)
def test_cli_errors_are_one_line_exit_2(
    small_trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    csv = tmp_path / "a.csv"
    csv.write_text("timestamp,input_tokens,output_tokens\n0,100,5\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(small_trace.read_text().splitlines()[0] + '\n{"timestamp": 1}\n')
    paths = {"trace": small_trace, "missing": tmp_path / "nope.jsonl", "csv": csv, "bad": bad}
    assert run([a.format(**paths) for a in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("kvgate: ") and message in captured.err
