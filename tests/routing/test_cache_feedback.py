"""The cache view corrected by what engines do: their answers (cached-token reports), their
refusals (nothing was cached), their stated capacity; and a retry that avoids the instance
that failed. Real Conductor, real KVIndex, real settings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import RoutingSettings, Settings
from routing.cache_feedback import CacheFeedback, assess
from routing.conductor import Conductor
from routing.kv_index import KVIndex
from routing.types import BlockStored, Decision, Rejection, RejectReason, RequestInfo
from tests.routing.fleet import BLOCK, fleet_settings, hold, prompt, request


def colocated(n: int = 2, ttl: float | None = 120.0) -> Conductor:
    s = fleet_settings(prefill=0, decode=0, colocated=n)
    return Conductor(replace(s, routing=replace(s.routing, predict_on_route_ttl_s=ttl)))


def place(
    c: Conductor, rid: str, blocks: tuple[int, ...], now: float = 0.0, **kw: object
) -> tuple[RequestInfo, Decision]:
    req = request(rid, blocks, now=now)
    d = c.schedule(req, now, **kw)  # type: ignore[arg-type]
    assert isinstance(d, Decision), d
    c.dispatched(d, req, now)
    return req, d


def answered(c: Conductor, rid: str, now: float, cached: int | None = None, prompt_n=None):
    c.first_token(rid, now)
    fb = c.cache_feedback(rid, now, cached, prompt_n)
    c.finished(rid, now)
    return fb


def held(c: Conductor, iid: str, blocks: tuple[int, ...]) -> int:
    return sum(c.index.holds(iid, h) for h in blocks)


# --- assess: the arithmetic -----------------------------------------------------------------


def test_assess_compares_whole_blocks_and_allows_for_the_recomputed_last_token() -> None:
    # Fully cached 10-block prompt: engines recompute the last token (reported 159 of 160).
    fb = assess("a", 160, 160, 159, 160, BLOCK)
    assert fb == CacheFeedback("a", 160, 160, 159, missed_blocks=0)
    # kvgate believed 8 blocks were cached, the engine had 3.
    assert assess("a", 160, 128, 48, 160, BLOCK).missed_blocks == 5
    # The engine had more than predicted: no miss.
    assert assess("a", 160, 0, 100, 160, BLOCK).missed_blocks == 0


def test_assess_scales_engine_tokens_to_kvgate_tokens() -> None:
    # The engine counts 1.5x kvgate's tokens (approximate tokenizer): 240 of 300 -> 160 of 200.
    fb = assess("a", 200, 160, 240, 300, BLOCK)
    assert fb.engine_cached_tokens == 160 and fb.missed_blocks == 0
    # Scaled counts get one block of slack: 8 predicted vs 7 reported is no miss...
    assert assess("a", 200, 128, 168, 300, BLOCK).missed_blocks == 0
    # ...but 8 vs 3 is.
    assert assess("a", 200, 128, 72, 300, BLOCK).missed_blocks == 4


def test_assess_without_a_report() -> None:
    fb = assess("a", 160, 64, None, None, BLOCK)
    assert fb.engine_cached_tokens is None and fb.missed_blocks == 0
    assert assess("a", 160, 64, -1, 160, BLOCK).engine_cached_tokens is None


# --- refusals: nothing recorded ---------------------------------------------------------------


def test_a_refused_request_leaves_no_predicted_blocks() -> None:
    c = colocated()
    long = prompt(7, 40)
    _, d = place(c, "r1", long)
    assert held(c, d.prefill, long) == 40  # predicted on route
    c.failed("r1", 0.1)  # the engine answered 400 (prompt longer than its context)
    assert held(c, d.prefill, long) == 0
    assert c.index.match(long, 0.2).best_blocks == 0
    # A repeat is placed on load alone, with no belief that anything is cached.
    _, d2 = place(c, "r2", long, now=0.2)
    assert d2.cached_tokens == 0


def test_a_refusal_keeps_what_the_engine_had_confirmed() -> None:
    c = colocated(1)
    system = prompt(7, 10)
    place(c, "warm", system)
    answered(c, "warm", 0.1)
    question = system + prompt(8, 5)
    place(c, "q", question, now=0.2)
    c.failed("q", 0.3)
    assert held(c, "c0", system) == 10 and held(c, "c0", prompt(8, 5)) == 0


def test_without_a_ttl_a_refusal_still_takes_its_route_back() -> None:
    c = colocated(1, ttl=None)
    held_before = prompt(7, 4)
    c.index.apply("c0", BlockStored(held_before), 0.0)
    place(c, "r", held_before + prompt(8, 6))
    c.failed("r", 0.1)
    assert held(c, "c0", held_before) == 4 and held(c, "c0", prompt(8, 6)) == 0


def test_a_failure_after_the_prefill_keeps_the_prompt() -> None:
    c = colocated(1)
    blocks = prompt(7, 12)
    place(c, "r", blocks)
    c.first_token("r", 0.05)  # the engine computed the prompt, then the stream broke
    c.failed("r", 0.5)
    assert held(c, "c0", blocks) == 12


# --- answers: confirm, and learn evictions ----------------------------------------------------


def test_an_answer_confirms_the_prompt_so_it_outlives_the_ttl() -> None:
    c = colocated(1, ttl=10.0)
    answered_blocks, unanswered = prompt(1, 6), prompt(2, 6)
    place(c, "a", answered_blocks)
    place(c, "b", unanswered)
    fb = answered(c, "a", 1.0)
    assert isinstance(fb, CacheFeedback) and fb.engine_cached_tokens is None
    assert not any(c.index.is_predicted("c0", h) for h in answered_blocks)
    assert c.index.match(answered_blocks, 50.0).best_blocks == 6
    assert c.index.match(unanswered, 50.0).best_blocks == 0  # nobody confirmed it: expired


def test_a_reported_miss_evicts_what_was_used_less_recently() -> None:
    c = colocated(1)
    old, system, newer = prompt(1, 8), prompt(2, 8), prompt(3, 8)
    for i, blocks in enumerate((old, system, newer)):
        place(c, f"w{i}", blocks, now=float(i))
        answered(c, f"w{i}", float(i) + 0.5)
    # kvgate predicts the system prompt cached; the engine had evicted it (a llama.cpp slot
    # was overwritten), and with it everything older.
    question = system + prompt(4, 4)
    _, d = place(c, "q", question, now=5.0)
    assert d.cached_tokens == 8 * BLOCK
    fb = answered(c, "q", 5.5, cached=0, prompt_n=len(question) * BLOCK)
    assert fb is not None and (fb.missed_blocks, fb.dropped_blocks) == (8, 8)
    assert held(c, "c0", old) == 0  # the oldest 8 blocks went
    assert held(c, "c0", newer) == 8 and held(c, "c0", question) == 12  # now cached
    # The engine keeps less than its stated capacity: the view keeps no more than is left.
    place(c, "n", prompt(5, 8), now=6.0)
    answered(c, "n", 6.5)
    assert c.index.blocks_held("c0") == (20, 0) and held(c, "c0", newer) == 0


def test_a_report_of_more_than_predicted_grows_the_capacity_back() -> None:
    c = colocated(1)
    c.set_capacity("c0", 20 * BLOCK)  # as stated by the engine
    a, b = prompt(1, 8), prompt(2, 8)
    for i, blocks in enumerate((a, b)):
        place(c, f"w{i}", blocks, now=float(i))
        answered(c, f"w{i}", float(i) + 0.5)
    place(c, "m", b + prompt(3, 2), now=2.0)
    answered(c, "m", 2.5, cached=0, prompt_n=10 * BLOCK)  # a miss: `a` goes, capacity 10
    assert c.index.blocks_held("c0") == (10, 0)

    def fill(tag: str, now: float) -> int:
        for i in range(3):
            place(c, f"{tag}{i}", prompt(100 + 10 * ord(tag[0]) + i, 8), now=now + i)
            answered(c, f"{tag}{i}", now + i + 0.5)
        return c.index.blocks_held("c0")[0]

    assert fill("x", 3.0) == 10
    # The engine still had `a` (8 blocks more than the view believed): the capacity grows...
    place(c, "h", a + prompt(4, 2), now=10.0)
    fb = answered(c, "h", 10.5, cached=8 * BLOCK, prompt_n=10 * BLOCK)
    assert fb is not None and fb.extra_blocks == 8
    assert fill("y", 11.0) == 18
    # ...but never past what the engine stated.
    place(c, "g", prompt(4, 8) + prompt(6, 2), now=20.0)
    answered(c, "g", 20.5, cached=8 * BLOCK, prompt_n=10 * BLOCK)
    assert fill("z", 21.0) == 20


def test_instances_with_kv_events_are_not_second_guessed() -> None:
    c = colocated(1)
    other, system = prompt(1, 8), prompt(2, 8)
    hold(c, "c0", other)  # a KV event: this engine reports its own evictions
    hold(c, "c0", system)
    question = system + prompt(4, 4)
    place(c, "q", question)
    fb = answered(c, "q", 0.5, cached=0, prompt_n=len(question) * BLOCK)
    assert fb is not None and fb.missed_blocks == 8 and fb.dropped_blocks == 0
    assert held(c, "c0", other) == 8


def test_a_disaggregated_answer_reports_the_decode_engine_not_the_prefill() -> None:
    c = Conductor(fleet_settings(prefill=1, decode=1))
    system = prompt(2, 8)
    hold(c, "p0", system)
    question = system + prompt(4, 4)
    place(c, "q", question)
    fb = answered(c, "q", 0.5, cached=0, prompt_n=len(question) * BLOCK)
    assert fb is not None and fb.engine_cached_tokens is None
    assert held(c, "p0", question) == 12


def test_unknown_requests_get_no_feedback() -> None:
    assert colocated().cache_feedback("nope", 0.0, 10, 10) is None


# --- capacity, retries, defaults --------------------------------------------------------------


def test_engine_capacity_replaces_the_profiles_and_bounds_the_view() -> None:
    c = colocated(1)
    assert c.instances["c0"].capacity_tokens > 100_000  # an H100 profile's
    for i in range(3):
        place(c, f"r{i}", prompt(i, 8), now=float(i))
        answered(c, f"r{i}", float(i))
    c.set_capacity("c0", 10 * BLOCK)  # llama.cpp: slots x n_ctx
    assert c.instances["c0"].capacity_tokens == 160
    assert c.index.blocks_held("c0") == (10, 0)
    assert held(c, "c0", prompt(2, 8)) == 8  # the most recent survive
    c.set_capacity("missing", 10)  # ignored


def test_a_retry_avoids_the_instance_that_failed() -> None:
    c = colocated(2)
    req = request("r", prompt(7, 4))
    first = c.schedule(req, 0.0)
    assert isinstance(first, Decision)
    again = c.schedule(req, 0.0, frozenset({first.prefill}))
    assert isinstance(again, Decision) and again.prefill != first.prefill
    none_left = c.schedule(req, 0.0, frozenset({"c0", "c1"}))
    assert isinstance(none_left, Rejection)
    assert none_left.reason is RejectReason.NO_HEALTHY_PREFILL


def test_predictions_expire_by_default() -> None:
    ttl = Settings().routing.predict_on_route_ttl_s
    assert ttl is not None and 0 < ttl < float("inf")
    assert RoutingSettings().predict_on_route_ttl_s == ttl


# --- KVIndex pieces -------------------------------------------------------------------------


def test_forget_route_drops_only_unconfirmed_blocks() -> None:
    idx = KVIndex(predicted_ttl_s=5.0)
    idx.add_instance("a", 100)
    added = idx.record_route("a", (1, 2, 3, 4), 0.0)
    assert set(added) == {1, 2, 3, 4}
    idx.apply("a", BlockStored((1, 2)), 0.1)  # the engine confirmed the first two
    assert idx.forget_route("a", added) == 2
    assert [idx.holds("a", h) for h in (1, 2, 3, 4)] == [True, True, False, False]
    assert idx.record_route("a", (1, 2), 0.2) == ()  # nothing new
    assert idx.forget_route("gone", (1,)) == 0


def test_settle_and_set_capacity_on_the_index() -> None:
    idx = KVIndex(predicted_ttl_s=5.0)
    idx.add_instance("a", 100)
    assert idx.settle("a", (1, 2, 3), 0, 0.0) == 0
    assert idx.holds("a", 3) and not idx.is_predicted("a", 3)
    assert idx.settle("a", (4, 5), 10, 1.0) == 3  # only older blocks go, never the prompt
    assert idx.blocks_held("a") == (2, 0)
    assert idx.settle("zzz", (1,), 1, 1.0) == 0
    idx.set_capacity("a", 1)
    assert idx.blocks_held("a") == (1, 0) and idx.holds("a", 4)  # block 4 is the prefix start
    with pytest.raises(ValueError):
        idx.set_capacity("a", -1)
