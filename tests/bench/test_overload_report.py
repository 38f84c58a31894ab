"""bench/overload_report.py: a phase's summary, on the real report types."""

from __future__ import annotations

import argparse

from bench.overload_report import Phase, PhaseRun, phase_summary
from replay.report.results import Outcome, RequestOutcome


def _done(rid: str, ttft_s: float, tbt_s: float) -> RequestOutcome:
    return RequestOutcome(rid, 0.0, 100, 8, Outcome.COMPLETED, ttft_s=ttft_s, tbt_mean_s=tbt_s)


def test_a_phase_says_which_slo_its_admitted_requests_missed() -> None:
    outcomes = [
        _done("ok", 0.5, 0.05),
        _done("late", 1.5, 0.05),
        _done("slow", 0.5, 0.3),
        _done("both", 2.0, 0.3),
        RequestOutcome("no", 0.0, 100, 8, Outcome.REJECTED, reason="ttft_slo"),
    ]
    run = PhaseRun([Phase("3x", 5.0, 1.0)], [outcomes], [[12.0]])
    args = argparse.Namespace(ttft_slo=1.0, tbt_slo=0.2)
    s = phase_summary(run, 0, args)
    assert (s["admitted"], s["rejected"], s["slo_met"]) == (4, 1, 1)
    assert s["admitted_slo_miss_ratio"] == 0.75
    assert (s["completed_over_ttft_slo"], s["completed_over_tbt_slo"]) == (2, 2)
    assert s["reject_ms"]["n"] == 1
