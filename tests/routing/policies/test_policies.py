"""Each policy's rule on small fleets, through the real Conductor."""

from __future__ import annotations

from routing.instance_books import DecodeWork
from routing.types import Decision
from tests.routing.fleet import busy, hold, make_conductor, prompt, request


def place(c, rid, blocks, now=0.0, dispatch=False):
    req = request(rid, blocks, now=now)
    d = c.schedule(req, now)
    assert isinstance(d, Decision)
    if dispatch:
        c.dispatched(d, req, now)
    return d


def test_round_robin_cycles_in_registration_order() -> None:
    c = make_conductor(policy="round_robin")
    assert [place(c, f"r{i}", prompt(i, 4)).prefill for i in range(6)] == [
        "p0",
        "p1",
        "p2",
        "p0",
        "p1",
        "p2",
    ]


def test_random_is_seeded_and_spreads() -> None:
    c = make_conductor(policy="random", prefill=4)
    chosen = [place(c, f"r{i}", prompt(i, 4)).prefill for i in range(200)]
    assert set(chosen) == {"p0", "p1", "p2", "p3"}
    assert max(chosen.count(p) for p in set(chosen)) < 80


def test_least_load_ignores_cache_and_takes_the_shortest_queue() -> None:
    c = make_conductor(policy="least_load")
    hold(c, "p0", prompt(1, 64))
    busy(c, "p0", 1.0)
    busy(c, "p1", 0.5)
    assert place(c, "r", prompt(1, 64)).prefill == "p2"


def test_longest_prefix_takes_the_most_cached_then_the_shorter_queue() -> None:
    c = make_conductor(policy="longest_prefix")
    hold(c, "p0", prompt(1, 20))
    hold(c, "p1", prompt(1, 40))
    hold(c, "p2", prompt(1, 40))
    busy(c, "p1", 10.0)
    d = place(c, "r", prompt(1, 64))
    assert d.prefill == "p2" and d.cached_tokens == 40 * 16


def test_cache_aware_trades_prefix_against_queue_but_never_pulls() -> None:
    c = make_conductor(policy="cache_aware")
    hold(c, "p0", prompt(1, 200))
    busy(c, "p0", 0.02)
    d = place(c, "r", prompt(1, 256))
    assert d.prefill == "p0"  # a short wait beats recomputing 200 blocks
    busy(c, "p0", 30.0)
    d = place(c, "r2", prompt(1, 256))
    assert d.prefill != "p0" and d.pull_source is None and d.cached_tokens == 0


def test_kvcache_centric_uses_store_tier_with_its_load_time() -> None:
    from routing.types import BlockStored

    c = make_conductor(policy="kvcache_centric")
    c.index.apply_store(BlockStored(prompt(1, 200)))  # the shared store holds the prefix
    d = place(c, "r", prompt(1, 256))
    assert d.pull_source == "store" and d.reason == "load_from_store"
    assert d.predicted_load_s > 0 and d.cached_tokens == 200 * 16
    assert d.replications == ()  # the engine loads from the store itself


def test_sglang_goes_to_the_match_above_threshold_else_least_loaded() -> None:
    c = make_conductor(policy="sglang_cache_aware")
    place(c, "warm1", prompt(1, 40), dispatch=True)  # p0's router tree now holds family 1
    place(c, "warm2", prompt(2, 10), dispatch=True)  # least loaded: p1's tree holds family 2
    assert place(c, "a", prompt(1, 64)).prefill == "p0"  # 40/64 = 0.62 > 0.3
    # 10/64 = 0.16 <= 0.3: least loaded (p2) instead of the holder p1
    assert place(c, "b", prompt(2, 10) + prompt(99, 54)).prefill == "p2"


def test_sglang_imbalance_rule_overrides_cache_affinity() -> None:
    c = make_conductor(policy="sglang_cache_aware", prefill=2)
    place(c, "warm", prompt(1, 60), dispatch=True)
    for i in range(70):  # 71 in flight on p0, 0 on p1: abs 71 > 64 and 71 > 1.5 * 0
        c.instances["p0"].enqueue_prefill(f"x{i}", 0.01, 16, 0.0, 0.0)
    assert place(c, "r", prompt(1, 64)).prefill == "p1"


def test_dynamo_cost_credits_overlap_and_charges_active_prefill_blocks() -> None:
    c = make_conductor(policy="dynamo_kv")
    hold(c, "p0", prompt(1, 50))
    # p0: 64 - 50 = 14 blocks; p1: 64 + 20 active blocks; p2: 64
    c.instances["p1"].enqueue_prefill("x", 0.1, 20 * 16, 0.0, 0.0)
    assert place(c, "r", prompt(1, 64)).prefill == "p0"
    # enough active work on p0 to outweigh its 50-block credit
    c.instances["p0"].enqueue_prefill("y", 0.1, 60 * 16, 0.0, 0.0)
    assert place(c, "r2", prompt(1, 64)).prefill == "p2"


def test_dynamo_decode_takes_the_fewest_active_blocks() -> None:
    c = make_conductor(policy="dynamo_kv", decode=2)
    c.instances["d0"].add_incoming(DecodeWork("x", 4096, 100, 0.0))
    assert place(c, "r", prompt(1, 8)).decode == "d1"


def test_llmd_prefers_prefix_weight_over_queue_weight() -> None:
    c = make_conductor(policy="llmd_weighted")
    first = place(c, "warm", prompt(1, 64), dispatch=True).prefill
    # re-scraped 100 ms later: the warm request runs on `first` (0 waiting), so queue scores
    # tie; first: 2*1 + 2*(1 - kv) + 3*1.0 ~ 7; others: 2 + 2 + 0 = 4
    assert place(c, "r", prompt(1, 64), now=0.1).prefill == first


def test_default_decode_choice_is_lowest_predicted_tbt() -> None:
    c = make_conductor(policy="least_load", decode=3)
    for i in range(30):
        c.instances["d0"].add_incoming(DecodeWork(f"a{i}", 2000, 100, 0.0))
        c.instances["d0"].start_decode(f"a{i}", 0.0)
    for i in range(5):
        c.instances["d2"].add_incoming(DecodeWork(f"b{i}", 2000, 100, 0.0))
        c.instances["d2"].start_decode(f"b{i}", 0.0)
    assert place(c, "r", prompt(1, 8)).decode == "d1"


def test_kvcache_centric_breaks_ties_among_idle_instances_idle_longest_first() -> None:
    """Equally idle instances: the tie goes to the one idle longest (cold work spreads over
    every cache instead of piling on the first instance); a replica's rotation starts that
    order further in, so that replicas deciding together pick different instances."""
    c = make_conductor(policy="kvcache_centric", prefill=3)
    busy(c, "p0", 5.0)  # idle again from t=5
    busy(c, "p1", 3.0)  # from t=3
    busy(c, "p2", 4.0)
    assert place(c, "a", prompt(1, 4), now=10.0).prefill == "p1"
    c.rotate_ties(1)
    assert place(c, "b", prompt(2, 4), now=10.0).prefill == "p2"
    c.rotate_ties(2)
    assert place(c, "c", prompt(3, 4), now=10.0).prefill == "p0"


def test_cold_prompts_on_an_idle_fleet_rotate_over_the_instances() -> None:
    c = make_conductor(policy="kvcache_centric", prefill=3)
    chosen = []
    for i, now in enumerate((0.0, 100.0, 200.0, 300.0)):  # each finished long before the next
        d = place(c, f"r{i}", prompt(10 + i, 4), now=now, dispatch=True)
        chosen.append(d.prefill)
        c.instances[d.prefill].finish_prefill(f"r{i}", now + 1.0)
    assert chosen == ["p0", "p1", "p2", "p0"]
