import pytest

from replay.report.prediction_errors import prediction_errors, relative_errors
from replay.report.report import summarize
from replay.report.results import Outcome, RequestOutcome, RunResult


def _done(i: int, ttft: float, pred_ttft: float, gen: int, pred_gen: int) -> RequestOutcome:
    return RequestOutcome(
        f"r{i}",
        float(i),
        100,
        gen,
        Outcome.COMPLETED,
        ttft_s=ttft,
        generated=gen,
        tbt_mean_s=0.05,
        predicted_ttft_s=pred_ttft,
        predicted_tbt_s=0.04,
        predicted_output_tokens=pred_gen,
    )


def test_relative_errors_by_hand() -> None:
    got = relative_errors([(1.5, 1.0), (0.5, 1.0), (None, 1.0), (1.0, 0.0)])
    assert got["n"] == 2  # a missing prediction and a zero observation are skipped
    assert got["p50"] == pytest.approx(0.5)
    assert got["mean_signed"] == pytest.approx(0.0)
    assert relative_errors([]) == {"n": 0}


def test_run_errors_cover_completed_requests_only() -> None:
    run = RunResult("x", "p", "early", 30.0, 0.1, duration_s=10.0)
    run.requests = [
        _done(0, 1.0, 0.5, 100, 200),
        _done(1, 2.0, 2.0, 50, 50),
        RequestOutcome("r2", 2.0, 100, 10, Outcome.REJECTED, predicted_ttft_s=99.0),
    ]
    errs = prediction_errors(run)
    assert errs["ttft"]["n"] == 2
    assert errs["ttft"]["mean_signed"] == pytest.approx(-0.25)  # (-0.5 + 0) / 2
    assert errs["output_tokens"]["mean_signed"] == pytest.approx(0.5)  # (+1 + 0) / 2
    assert errs["tbt"]["mean_signed"] == pytest.approx(-0.2)
    summary = summarize(run)
    assert summary["prediction_errors"]["ttft"]["n"] == 2
    # 2 admitted, both within SLO (ttft 1 and 2 s < 30 s, TBT 50 ms < 100 ms)
    assert summary["admitted_slo_miss_ratio"] == 0.0
