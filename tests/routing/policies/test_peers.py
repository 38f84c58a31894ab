"""The peer policies' formulas on hand-computed cases (docs/peer-fidelity.md)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from routing.instance_books import DecodeWork
from routing.policies.peer_dynamo import DynamoKVPolicy, softmax_pick
from routing.policies.peer_llmd import EngineMetrics
from routing.policies.router_prefix import RouterPrefixIndex
from routing.types import Decision
from tests.routing.fleet import BLOCK, fleet_settings, hold, make_conductor, prompt, request


def place(c, rid, blocks, now=0.0, dispatch=True):
    req = request(rid, blocks, now=now)
    d = c.schedule(req, now)
    assert isinstance(d, Decision)
    if dispatch:
        c.dispatched(d, req, now)
    return d


def capture_ctx(c):
    """Record the PlacementContext the Conductor hands the policy."""
    seen = []
    orig = c.policy.select_prefill

    def select(ctx):
        seen.append(ctx)
        return orig(ctx)

    c.policy.select_prefill = select
    return seen


class FixedRng:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value

    def choice(self, seq):
        return seq[0]


# ------------------------------------------------------------------ router-side prefix index
def test_router_prefix_index_matches_leading_blocks_and_evicts_lru() -> None:
    idx = RouterPrefixIndex(capacity_blocks=4)
    idx.insert("a", (1, 2, 3))
    assert idx.match("a", (1, 2, 9)) == 2 and idx.match("a", (9, 1)) == 0
    idx.insert("a", (1, 5))  # touches 1; 4 blocks now: 2, 3, 1, 5
    idx.insert("a", (6,))  # evicts the least recently used: 2
    assert idx.match("a", (1, 5, 6)) == 3 and idx.match("a", (1, 2)) == 1
    assert idx.size("a") == 4 and idx.match("b", (1,)) == 0


# ------------------------------------------------------------------ SGLang / SMG
def test_sglang_follows_its_own_tree_not_the_engine_cache() -> None:
    c = make_conductor(policy="sglang_cache_aware")
    hold(c, "p2", prompt(1, 64))  # the engine cache: invisible to the HTTP-mode tree
    assert place(c, "a", prompt(1, 64)).prefill == "p0"  # no tree match: least loaded
    # 40/64 = 0.62 > 0.3 of the prompt is in p0's tree: cache affinity despite its load
    assert place(c, "b", prompt(1, 40) + prompt(7, 24)).prefill == "p0"
    # 10/64 = 0.16 <= 0.3: least loaded, argmin (load, processed count, index) = p1
    assert place(c, "c", prompt(1, 10) + prompt(8, 54)).prefill == "p1"


def test_sglang_event_mode_uses_engine_overlap() -> None:
    routing = replace(fleet_settings(policy="sglang_cache_aware").routing)
    routing = replace(routing, params={"cache_view": "events"})
    c = make_conductor(policy="sglang_cache_aware", routing=routing)
    hold(c, "p2", prompt(1, 4))  # 4/64 blocks: below the tree threshold, but overlap > 0
    assert place(c, "a", prompt(1, 64)).prefill == "p2"


def test_sglang_imbalance_goes_to_least_loaded() -> None:
    c = make_conductor(policy="sglang_cache_aware", prefill=2)
    place(c, "warm", prompt(1, 64))  # p0's tree holds the prefix
    for i in range(70):  # 71 in flight on p0, 0 on p1: 71 - 0 > 64 and 71 > 1.5 * 0
        c.instances["p0"].enqueue_prefill(f"x{i}", 0.01, 16, 0.0, 0.0)
    assert place(c, "r", prompt(1, 64)).prefill == "p1"


def test_sglang_power_of_two_decode_compares_polled_token_usage() -> None:
    c = make_conductor(policy="sglang_cache_aware", decode=2)
    d0 = c.instances["d0"]
    d0.add_incoming(DecodeWork("x", 4096, 10, 0.0))
    d0.start_decode("x", 0.0)  # d0's token usage > d1's at the first poll
    assert place(c, "r", prompt(1, 8)).decode == "d1"


# ------------------------------------------------------------------ Dynamo
def test_dynamo_prefill_cost_charges_uncached_active_tokens() -> None:
    c = make_conductor(policy="dynamo_kv")
    seen = capture_ctx(c)
    hold(c, "p0", prompt(1, 50))
    c.instances["p1"].enqueue_prefill("other", 0.1, 20 * BLOCK, 0.0, 0.0)  # not ours: in full
    req = request("a", prompt(1, 64))
    d = c.schedule(req, 0.0)
    assert isinstance(d, Decision) and d.prefill == "p0"
    # raw = (active + ISL) / 16; cost = max(raw - credit, 0): p0 64 - 50, p1 (320+1024)/16, p2 64
    assert c.policy.prefill_costs(seen[-1]) == [14.0, 84.0, 64.0]
    c.dispatched(d, req, 0.0)
    # p0 now holds a's 14 uncached blocks (224 tokens), not its 1024 prompt tokens
    assert c.policy.active_prefill_tokens(c.instances["p0"]) == 14 * BLOCK
    place(c, "b", prompt(1, 64), dispatch=False)
    credit = seen[-1].match.gpu_blocks.get("p0", 0)
    assert c.policy.prefill_costs(seen[-1])[0] == pytest.approx((224 + 1024) / 16 - credit)


def test_dynamo_credit_decay_shrinks_the_busy_holders_credit() -> None:
    policy = DynamoKVPolicy(overlap_score_credit_decay=1.0)
    c = make_conductor(policy="dynamo_kv")
    c.policy = policy
    seen = capture_ctx(c)
    hold(c, "p0", prompt(1, 32))
    c.instances["p0"].enqueue_prefill("o", 0.1, 64 * BLOCK, 0.0, 0.0)  # 64 blocks over floor
    place(c, "a", prompt(1, 64), dispatch=False)
    # decay = 1 / (1 + 1.0 * 64 / 64) = 0.5; p0: (1024 + 1024)/16 - 0.5 * 32 = 112
    assert policy.prefill_costs(seen[-1])[0] == pytest.approx(112.0)


def test_dynamo_decode_counts_prompt_blocks_per_sequence() -> None:
    c = make_conductor(policy="dynamo_kv", decode=2)
    c.instances["d0"].add_incoming(DecodeWork("x", 100, 4000, 0.0))  # 7 blocks, long output
    for i in range(3):
        c.instances["d1"].add_incoming(DecodeWork(f"y{i}", 17, 10, 0.0))  # 3 x 2 blocks
    assert place(c, "r", prompt(1, 8)).decode == "d1"  # 6 + 8 < 7 + 8


def test_dynamo_softmax_sampling_is_dynamos_normalised_softmax() -> None:
    # costs [0, 1] at T = 1: p = exp(0) : exp(-1) -> 0.731 / 0.269
    p0 = 1.0 / (1.0 + math.exp(-1.0))
    assert softmax_pick([0.0, 1.0], 1.0, FixedRng(p0 - 0.01)) == 0
    assert softmax_pick([0.0, 1.0], 1.0, FixedRng(p0 + 0.01)) == 1
    # normalised: costs [10, 20] behave exactly like [0, 1]
    assert softmax_pick([10.0, 20.0], 1.0, FixedRng(p0 + 0.01)) == 1
    assert softmax_pick([3.0, 1.0, 2.0], 0.0, FixedRng(0.0)) == 1  # T = 0: argmin


# ------------------------------------------------------------------ llm-d / GIE
def test_llmd_prefix_score_uses_its_own_index_and_the_hash_limit() -> None:
    c = make_conductor(policy="llmd_weighted")
    c.policy.max_prefix_tokens = 4 * BLOCK  # 4 hashed blocks instead of 256 x 16 tokens
    first = place(c, "a", prompt(1, 8)).prefill
    # the same first 4 blocks, different afterwards: prefix score 4/4 = 1 on `first`
    # first: 2*1 + 2*(1 - kv) + 3*1 ~ 7 > others 2 + 2 + 0 = 4 (metrics not re-scraped yet)
    assert place(c, "b", prompt(1, 4) + prompt(9, 4)).prefill == first


def test_llmd_metrics_are_scraped_not_live() -> None:
    c = make_conductor(policy="llmd_weighted")
    p0 = c.instances["p0"]
    m = EngineMetrics(0.05)
    assert m.get([p0], 0.0) == [(0.0, 0.0)]
    for i in range(3):
        p0.enqueue_prefill(f"x{i}", 1.0, 160, 0.0, 0.0)
    assert m.get([p0], 0.04) == [(0.0, 0.0)]  # same scrape
    waiting, kv = m.get([p0], 0.05)[0]
    assert waiting == 2.0 and kv == pytest.approx(160 / p0.capacity_tokens)
