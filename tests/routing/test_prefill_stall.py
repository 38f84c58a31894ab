"""The stall a colocated instance's new prefill leaves to its decodes, on hand-computed cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import PredictorSettings, Role
from predictors.bundle import build_instance_predictors
from predictors.decode import DecodeStepModel
from routing.estimates import PrefillOption
from routing.instance_books import DecodeWork, InstanceState
from routing.prefill_stall import decode_part_s, running_slack, stalled_tbt

TAU = 0.1  # TBT SLO, s


def colocated() -> InstanceState:
    """Decode steps of 20 ms whatever the batch (no per-sequence part), 1,000-token chunks."""
    preds = build_instance_predictors(PredictorSettings(), "llama3-8b-h100-tp1")
    preds = replace(
        preds,
        decode=DecodeStepModel(a_ms=20.0, b_ms=0.0, k_ms=0.0),
        profile=replace(preds.profile, max_batched_tokens=1000),
    )
    return InstanceState("c0", Role.BOTH, preds, capacity_tokens=1_000_000, max_batch=64)


def option(inst: InstanceState, queue_s: float = 0.0, prefill_s: float = 0.5) -> PrefillOption:
    return PrefillOption(inst, queue_s + prefill_s, queue_s, prefill_s, 0.0, 0.0, 0, 0)


def decoding(inst: InstanceState, rid: str, output: int, made: int, now: float) -> None:
    """A decode that started at 0 and has reported ``made`` tokens at ``now``."""
    inst.add_incoming(DecodeWork(rid, 1000, output, 0.0))
    inst.start_decode(rid, 0.0)
    inst.add_tokens(rid, made, now)


def test_a_decode_with_future_slack_absorbs_the_stall() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=10, now=1.0)
    # Slack: 10 tokens x 0.1 s - 1.0 s elapsed + 90 to come x (0.1 - 0.02) s = 7.2 s.
    # The prefill: 0.5 s in one mixed step that still yields a token: costs 0.5 - 0.1 = 0.4 s.
    assert stalled_tbt(i, option(i), 500, 1.0, TAU, credit=1.0) == pytest.approx(
        TAU + (0.4 - 7.2) / 100
    )


def test_without_credit_for_the_future_the_stall_breaks_the_slo() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=10, now=1.0)
    # Banked slack 0: the 0.4 s over 100 tokens makes a mean TBT of 104 ms.
    assert stalled_tbt(i, option(i), 500, 1.0, TAU, credit=0.0) == pytest.approx(0.104)
    # Spread over two chunk steps, each yielding a token: 0.5 - 0.2 = 0.3 s.
    assert stalled_tbt(i, option(i), 1500, 1.0, TAU, credit=0.0) == pytest.approx(0.103)


def test_a_decode_past_saving_does_not_count() -> None:
    i = colocated()
    decoding(i, "late", output=100, made=10, now=2.0)  # 10 tokens in 2 s: already 1 s behind
    assert stalled_tbt(i, option(i), 500, 2.0, TAU, credit=0.0) == 0.0
    assert stalled_tbt(colocated(), option(i), 500, 2.0, TAU, credit=1.0) == 0.0  # no decodes


def test_a_decode_the_queue_alone_dooms_does_not_count() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=10, now=1.0)
    i.enqueue_prefill("q", 1.0, 900, now=1.0, ready_s=1.0)  # 1 s ahead: costs 0.9 s of slack
    # With credit 0.1 the decode has 0.72 s of slack: the queue alone takes it past the SLO.
    assert stalled_tbt(i, option(i, queue_s=1.0), 500, 1.0, TAU, credit=0.1) == 0.0
    # With credit 1 (7.2 s) it is saveable: the queue and this prefill, two steps, 1.3 s.
    assert stalled_tbt(i, option(i, queue_s=1.0), 500, 1.0, TAU, credit=1.0) == pytest.approx(
        TAU + (1.5 - 0.2 - 7.2) / 100
    )


def test_a_request_queued_here_is_stalled_by_what_comes_after_it() -> None:
    i = colocated()
    i.enqueue_prefill("q", 1.0, 900, now=0.0, ready_s=0.0)
    i.add_incoming(DecodeWork("q", 900, 50, 1.0))
    # q decodes here after its prefill; only the new one runs after it: 0.5 - 0.1 = 0.4 s
    # against 50 x 0.08 x 0.05 = 0.2 s of credited slack, over its 50 tokens.
    assert stalled_tbt(i, option(i, queue_s=1.0), 500, 0.0, TAU, credit=0.05) == pytest.approx(
        TAU + (0.4 - 0.2) / 50
    )


def test_running_slack_counts_the_steps_since_the_last_report() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=10, now=1.0)
    # 0.2 s later the step clock (20 ms steps) says 10 more tokens were made.
    [(slack, made, left)] = list(running_slack(i, 1.2, TAU, gain_s=0.0))
    assert slack == pytest.approx(20 * TAU - 1.2)
    assert (made, left) == pytest.approx((20, 80))
    assert decode_part_s(i) == 0.0


def test_the_stall_is_the_booked_prefill_work_not_the_scaled_wait() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=10, now=1.0)
    i.enqueue_prefill("q", 1.0, 900, now=1.0, ready_s=1.0)
    i.queue_scale = 4.0  # the engine answers 4x later than booked: decodes run meanwhile
    assert i.queue_time(1.0) == pytest.approx(4.0)
    scaled = option(i, queue_s=i.queue_time(1.0))
    assert stalled_tbt(i, scaled, 500, 1.0, TAU, credit=1.0) == pytest.approx(
        TAU + (1.5 - 0.2 - 7.2) / 100
    )


def test_a_decode_done_before_the_prefill_starts_does_not_count() -> None:
    i = colocated()
    decoding(i, "r", output=100, made=95, now=1.0)  # 25 more expected: done at 1.5
    assert stalled_tbt(i, option(i), 500, 1.0, TAU, credit=0.0) > 0.0
    i.enqueue_prefill("q", 1.0, 900, now=1.0, ready_s=1.0)  # the new prefill starts at 2.0
    assert stalled_tbt(i, option(i, queue_s=1.0), 500, 1.0, TAU, credit=0.0) == 0.0


def test_on_a_full_engine_the_prefill_waits_for_a_sequence_and_spares_the_one_leaving() -> None:
    i = replace(colocated(), max_batch=2)  # llama.cpp's -np 2
    decoding(i, "short", output=8, made=6, now=0.55)  # leaves after 2 more steps, at 0.59
    decoding(i, "long", output=400, made=6, now=0.55)
    assert i.prefill_start_s(0.55) == pytest.approx(0.59)
    # Both saved 6 x 0.1 - 0.55 = 0.05 s; the prefill (0.4 s of slack in one step) reaches
    # only the long one: spread over its 400 tokens. Counting the short one would give
    # 0.1 + 0.35 / 8 = 0.144 s.
    placed = option(i, queue_s=i.queue_time(0.55))  # the estimator's wait for the slot
    assert stalled_tbt(i, placed, 500, 0.55, TAU, credit=0.0) == pytest.approx(TAU + 0.35 / 400)


def test_a_queued_request_safe_whatever_its_output_length_is_no_concern() -> None:
    """A request queued here that could end one token after its first and still meet the
    SLO through every stall ahead of it (0.05 s here, within tau - d = 0.08 s) is left out:
    its credited slack (50 x 0.08 x 0.05 = 0.2 s) would put its mean at tau - 4 ms = 96 ms
    whatever the stall, over a 90 ms class limit, so that a burst of requests onto an idle
    instance was turned away one by one (real vLLM, docs/real-engines.md)."""
    i = colocated()
    i.enqueue_prefill("q", 1.0, 900, now=0.0, ready_s=0.0)
    i.add_incoming(DecodeWork("q", 900, 50, 1.0))
    small = option(i, queue_s=1.0, prefill_s=0.05)
    assert stalled_tbt(i, small, 50, 0.0, TAU, credit=0.05, limit_s=0.09) == 0.0
    # The class keeps its headroom: 0.075 s is within tau - d but over 90 % of it.
    larger = option(i, queue_s=1.0, prefill_s=0.075)
    assert stalled_tbt(i, larger, 50, 0.0, TAU, credit=0.05) == 0.0
    assert stalled_tbt(i, larger, 50, 0.0, TAU, credit=0.05, limit_s=0.09) == pytest.approx(
        TAU + (0.075 - 0.1 - 0.2) / 50
    )
    # A running decode keeps the hedged check: it may already be close to its end.
    r = colocated()
    decoding(r, "r", output=100, made=10, now=1.0)
    assert stalled_tbt(r, option(r, prefill_s=0.05), 50, 1.0, TAU, credit=0.0) > 0.0
