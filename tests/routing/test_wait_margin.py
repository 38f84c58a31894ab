"""The margin on predicted waits, learned from the admitted requests' first tokens
(routing/wait_margin.py), and how admission and the Conductor's books use it. Real types."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.admission_settings import WaitMarginSettings
from config.settings import AdmissionMode
from routing.admission import Admission, resolve_slo
from routing.types import Decision, Rejection, RejectReason
from routing.wait_margin import WaitMarginControl
from tests.routing.fleet import busy, fleet_settings, make_conductor, prompt, request

SETTINGS = WaitMarginSettings(window=10, target_miss=0.1, raise_gain=2.0, lower_step=0.5)


def _window(c: WaitMarginControl, misses: int, n: int = 10) -> None:
    for i in range(n):
        c.observe(i < misses)


def test_misses_over_the_target_raise_the_factor_in_proportion() -> None:
    c = WaitMarginControl(SETTINGS)
    _window(c, 5)  # 50 % late: x (1 + 2 x 0.5)
    assert c.factor == pytest.approx(2.0) and c.raised == 1
    _window(c, 1)  # 10 %: at the target, not under half of it: no move
    assert c.factor == pytest.approx(2.0)
    _window(c, 0)
    assert c.factor == pytest.approx(1.0) and c.lowered == 1
    _window(c, 0)  # never below 1: the wait as predicted
    assert c.factor == 1.0 and c.lowered == 1
    for _ in range(5):
        _window(c, 10)
    assert c.factor == SETTINGS.max_factor


def test_nothing_moves_before_a_window_fills_or_when_not_adaptive() -> None:
    c = WaitMarginControl(SETTINGS)
    _window(c, 9, n=9)
    assert c.factor == 1.0
    fixed = WaitMarginControl(replace(SETTINGS, adaptive=False))
    _window(fixed, 10, n=50)
    assert fixed.factor == 1.0 and fixed.raised == 0


def test_the_factor_stretches_the_wait_not_the_prefill() -> None:
    s = replace(fleet_settings().admission, mode=AdmissionMode.EARLY, wait_margin=SETTINGS)
    a = Admission(s)
    a.wait_margin_for(None).factor = 3.0
    req = request("r", prompt(1, 4))
    slo = resolve_slo(req, fleet_settings().slo)  # 30 s, normal keeps 10 %: limit 27 s
    assert a.check(req, slo, 20.0, 0.01, 1.0, wait_s=0.0) is None  # a long prefill, no queue
    assert a.check(req, slo, 20.0, 0.01, 1.0, wait_s=3.0) is None  # 20 + 2 x 3 = 26
    rejected = a.check(req, slo, 20.0, 0.01, 1.0, wait_s=4.0)  # 20 + 2 x 4 = 28 > 27
    assert isinstance(rejected, Rejection) and rejected.reason is RejectReason.TTFT_SLO
    assert rejected.predicted_ttft_s == 20.0  # as predicted, before the margins
    assert "28000 ms" in rejected.message


def test_only_the_slo_modes_learn() -> None:
    s = replace(fleet_settings().admission, wait_margin=SETTINGS)
    for mode, learns in ((AdmissionMode.EARLY, True), (AdmissionMode.NONE, False)):
        a = Admission(replace(s, mode=mode))
        for _ in range(10):
            a.observe_first_token(None, True)
        assert (a.wait_margin_for(None).factor > 1.0) is learns


def _dispatched(c, rid: str, now: float = 0.0, **kw: object) -> Decision:
    d = c.schedule(request(rid, prompt(3, 8), **kw), now)
    assert isinstance(d, Decision)
    c.dispatched(d, request(rid, prompt(3, 8), **kw), now)
    return d


def test_the_books_count_the_first_tokens_of_promised_streamed_answers() -> None:
    c = make_conductor(admission=AdmissionMode.EARLY)
    margin = c.admission.wait_margin_for(None)
    _dispatched(c, "late")
    c.first_token("late", 31.0)  # over the 30 s TTFT SLO
    c.finished("late", 32.0, output_tokens=11)
    _dispatched(c, "soon")
    c.first_token("soon", 1.0)
    c.finished("soon", 2.0, output_tokens=11)
    _dispatched(c, "whole")
    c.first_token("whole", 40.0)  # a non-streamed answer: its first token came with its last
    c.finished("whole", 40.0, output_tokens=11, decode_timed=False)
    _dispatched(c, "lost")
    c.failed("lost", 1.5)  # never answered: no first token to judge
    assert (margin.outcomes.seen, margin.outcomes.missed) == (2, 1)


def test_a_learned_factor_turns_away_what_the_plain_wait_admits() -> None:
    c = make_conductor(admission=AdmissionMode.EARLY, prefill=1)
    busy(c, "p0", 20.0)  # 20 s queued on the one prefill instance; the limit is 27 s
    assert isinstance(c.schedule(request("b", prompt(5, 4)), 0.0), Decision)
    c.admission.wait_margin_for(None).factor = 1.5  # 20 s of wait reads as 30 s
    rejected = c.schedule(request("c", prompt(5, 4)), 0.0)
    assert isinstance(rejected, Rejection) and rejected.reason is RejectReason.TTFT_SLO
