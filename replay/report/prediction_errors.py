"""How wrong the Conductor's predictions were in a replay run, per request.

Admission and placement are only as good as three predictions, so every report carries their
errors (``summarize`` copies these in as ``prediction_errors``):

- ``ttft``: predicted TTFT at the decision vs the TTFT the request saw (completed requests);
- ``output_tokens``: the output-length predictor's guess vs the tokens really generated;
- ``tbt``: the decode forecast behind admission's TBT check (the TBT predicted for the
  request's decode instance at the decision) vs the mean TBT it saw.

Each gives the count, the median and p90 of ``|pred - obs| / obs``, the mean signed error
``(pred - obs) / obs`` (negative = optimistic) and ``sum_ratio`` = sum(pred) / sum(obs): relative
errors of short outputs are huge (3 tokens predicted as 300 is +9,900 %), while what a load
forecast feels is the totals.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from replay.report.results import Outcome, RunResult


def relative_errors(pairs: Iterable[tuple[float | None, float | None]]) -> dict[str, float | int]:
    kept = [(p, o) for p, o in pairs if p is not None and o is not None and o > 0]
    if not kept:
        return {"n": 0}
    signed = [(p - o) / o for p, o in kept]
    arr = np.asarray(signed)
    rel = np.abs(arr)
    return {
        "n": len(signed),
        "p50": float(np.percentile(rel, 50)),
        "p90": float(np.percentile(rel, 90)),
        "mean_signed": float(arr.mean()),
        "sum_ratio": sum(p for p, _ in kept) / sum(o for _, o in kept),
    }


def prediction_errors(run: RunResult) -> dict[str, dict[str, float | int]]:
    done = [r for r in run.requests if r.outcome is Outcome.COMPLETED]
    return {
        "ttft": relative_errors((r.predicted_ttft_s, r.ttft_s) for r in done),
        "output_tokens": relative_errors(
            (r.predicted_output_tokens, r.generated or None) for r in done
        ),
        "tbt": relative_errors((r.predicted_tbt_s, r.tbt_mean_s) for r in done),
    }
