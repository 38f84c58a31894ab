from __future__ import annotations

import pytest

from config.settings import PredictorSettings, Role
from predictors.bundle import build_instance_predictors
from routing.instance_books import DecodeWork, InstanceState


def inst(role: Role = Role.DECODE) -> InstanceState:
    preds = build_instance_predictors(PredictorSettings(), "llama3-8b-h100-tp1")
    return InstanceState("i", role, preds, capacity_tokens=100_000, max_batch=64)


def test_fcfs_queue_time_and_reanchoring_on_early_completion() -> None:
    i = inst(Role.PREFILL)
    i.enqueue_prefill("a", 1.0, 100, now=0.0, ready_s=0.0)
    i.enqueue_prefill("b", 2.0, 100, now=0.0, ready_s=0.0)
    assert i.queue_time(0.0) == pytest.approx(3.0)
    assert i.queue_time(1.0) == pytest.approx(2.0)
    i.finish_prefill("a", 0.5)  # finished early: b starts now
    assert i.queue_time(0.5) == pytest.approx(2.0)
    assert i.queued_tokens == 100
    i.finish_prefill("b", 2.5)
    assert i.queue_time(2.5) == 0.0 and i.queued_tokens == 0


def test_an_overdue_prefill_keeps_the_ones_behind_it_unstarted() -> None:
    i = inst(Role.PREFILL)
    i.enqueue_prefill("a", 1.0, 100, now=0.0, ready_s=0.0)
    i.enqueue_prefill("b", 2.0, 100, now=0.0, ready_s=0.0)
    i.enqueue_prefill("c", 0.5, 100, now=0.0, ready_s=0.0)
    # At 1.5 "a" should have been done for 0.5 s; no first token yet, so "b" and "c" have
    # not started: 2.5 s of work from now, not the 2.0 s the booked finish (3.5) leaves.
    assert i.queue_time(1.5) == pytest.approx(2.5)
    # Long past every booked finish, the queue still holds b and c.
    assert i.queue_time(10.0) == pytest.approx(2.5)
    w = i.enqueue_prefill("d", 1.0, 100, now=10.0, ready_s=0.0)
    assert (w.est_start_s, w.est_finish_s) == pytest.approx((12.5, 13.5))
    i.finish_prefill("a", 10.0)  # b starts now: c waits for it
    assert i.queue_time(10.0) == pytest.approx(3.5)
    i.lengthen_prefills({"c": 1.5}, 10.0)
    assert i.queued_prefill_s == pytest.approx(4.5)
    i.remove_prefills(["b", "c", "d"], 10.0)
    assert i.queued_prefill_s == 0.0 and i.queue_time(10.0) == 0.0


def test_prefill_waits_for_its_pull() -> None:
    i = inst(Role.PREFILL)
    w = i.enqueue_prefill("a", 1.0, 100, now=0.0, ready_s=0.5)
    assert (w.est_start_s, w.est_finish_s) == (0.5, 1.5)


def test_decode_totals_follow_the_step_model() -> None:
    i = inst()
    for k in range(32):
        i.add_incoming(DecodeWork(f"r{k}", 1000, 100, 0.0))
        i.start_decode(f"r{k}", 0.0)
    i.add_tokens("r0", 24, 0.1)
    assert (i.batch, i.context_tokens) == (32, 32 * 1000 + 24)
    assert i.tbt_now() == pytest.approx(i.predictors.decode.step_time(32, 32_024))
    i.remove_decode("r0", 0.1)
    assert (i.batch, i.context_tokens) == (31, 31_000)
    assert i.reserved_tokens == 31 * 1100


def test_forecast_drops_finishing_and_adds_arriving() -> None:
    i = inst()
    i.add_incoming(DecodeWork("soon", 500, 1, 0.0))
    i.start_decode("soon", 0.0)  # finishes after one step
    i.add_incoming(DecodeWork("late", 500, 10_000, 0.0))
    i.start_decode("late", 0.0)
    i.add_incoming(DecodeWork("arriving", 700, 100, est_arrival_s=1.0))
    now = i.forecast(0.0, 0.0, 300)
    assert now.batch == 3  # two running + the new one
    later = i.forecast(2.0, 0.0, 300)
    assert later.batch == 3  # "soon" left, "arriving" joined, + the new one
    assert later.context_tokens > 500 + 700 + 300  # "late" grew meanwhile


def test_kv_capacity_accounting() -> None:
    i = inst()
    i.add_incoming(DecodeWork("a", 60_000, 30_000, 0.0))
    assert not i.kv_fits(20_000)
    assert i.kv_fits(10_000)
    assert i.clear_work() == ["a"] and i.reserved_tokens == 0


def _colocated(max_batch: int) -> InstanceState:
    preds = build_instance_predictors(PredictorSettings(), "llama3-8b-h100-tp1")
    return InstanceState("c", Role.BOTH, preds, capacity_tokens=100_000, max_batch=max_batch)


def _book(i: InstanceState, rid: str, prefill_s: float, output: int, now: float) -> None:
    """As the Conductor books a colocated request: its prefill here, its decode heading here."""
    i.enqueue_prefill(rid, prefill_s, 100, now=now, ready_s=now)
    i.add_incoming(DecodeWork(rid, 100, output, now))


def test_a_full_colocated_engine_queues_until_a_sequence_leaves() -> None:
    i = _colocated(max_batch=2)  # llama-server -np 2
    for rid in ("a", "b"):
        _book(i, rid, 0.1, 50, 0.0)
        i.finish_prefill(rid, 0.1)
        i.start_decode(rid, 0.1)
    tbt = i.tbt_now()  # both decoding: the engine is full
    # Prefills are done, both places decode for 50 steps: a prefill-only queue says 0.
    assert i.busy_until_s <= 0.1
    assert i.queue_time(0.1) == pytest.approx(50 * tbt)
    i.add_tokens("a", 40, 0.1 + 40 * tbt)  # a is near its end: the first place frees sooner
    assert i.queue_time(0.1 + 40 * tbt) == pytest.approx(10 * i.tbt_now(), rel=0.01)
    i.remove_decode("a", 0.2 + 50 * tbt)
    assert i.queue_time(0.2 + 50 * tbt) == 0.0  # a place is free


def test_booked_requests_take_the_places_that_free_first() -> None:
    i = _colocated(max_batch=1)
    _book(i, "a", 0.5, 10, 0.0)  # holds the only place: prefill 0.5 s, then 10 tokens
    _book(i, "b", 0.5, 10, 0.0)  # waits for it
    tbt = i.predictors.decode.step_time(1, 200)  # one sequence decodes at a time
    a_leaves = 0.5 + 10 * tbt
    assert i.queue_time(0.0) == pytest.approx(a_leaves + 0.5 + 10 * tbt)  # after b leaves too


def test_roomy_or_disaggregated_engines_keep_the_prefill_queue() -> None:
    roomy = _colocated(max_batch=8)
    _book(roomy, "a", 0.5, 1000, 0.0)
    assert roomy.queue_time(0.0) == pytest.approx(0.5)
    prefill = InstanceState("p", Role.PREFILL, roomy.predictors, 100_000, max_batch=1)
    prefill.enqueue_prefill("a", 0.5, 100, now=0.0, ready_s=0.0)
    prefill.enqueue_prefill("b", 0.5, 100, now=0.0, ready_s=0.0)
    assert prefill.queue_time(0.0) == pytest.approx(1.0)  # its sequences leave for decode


def test_the_recent_prefill_share_is_a_decayed_rate_of_finished_prefill_work() -> None:
    from math import exp

    from routing.instance_books import MAX_PREFILL_SHARE, PREFILL_SHARE_TAU_S

    i = _colocated(8)
    assert i.prefill_share(0.0) == 0.0
    i.enqueue_prefill("a", 2.0, 100, now=0.0, ready_s=0.0)
    i.enqueue_prefill("b", 2.0, 100, now=0.0, ready_s=0.0)
    i.finish_prefill("a", 2.0)
    i.finish_prefill("b", 4.0)
    # a's 2 s decayed over the 2 s to b's end, plus b's 2 s, over the time constant.
    share = (2.0 * exp(-2.0 / PREFILL_SHARE_TAU_S) + 2.0) / PREFILL_SHARE_TAU_S
    assert i.prefill_share(4.0) == pytest.approx(share)
    assert i.prefill_share(4.0 + PREFILL_SHARE_TAU_S) == pytest.approx(share / exp(1.0))
    for n in range(40):  # busy prefilling all the time: capped
        i.enqueue_prefill(f"x{n}", 1.0, 100, now=4.0 + n, ready_s=4.0 + n)
        i.finish_prefill(f"x{n}", 5.0 + n)
    assert i.prefill_share(44.0) == MAX_PREFILL_SHARE


def test_only_an_instance_that_prefilled_has_a_prefill_share() -> None:
    i = _colocated(8)
    i.enqueue_prefill("a", 5.0, 100, now=0.0, ready_s=0.0)
    i.finish_prefill("a", 5.0)
    assert i.prefill_share(5.0) == pytest.approx(5.0 / 20.0)
    assert inst(Role.DECODE).prefill_share(5.0) == 0.0  # no prefill finished here
