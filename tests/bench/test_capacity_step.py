"""bench/capacity_step.py: the step trace and the step-response reading (no live run)."""

from __future__ import annotations

import random

from bench.capacity_step import step_response, step_trace, tracking
from replay.workload.traces import TraceRequest


def test_step_trace_doubles_the_rate_at_the_phase() -> None:
    base = [TraceRequest(i, float(i), 100, 10, ()) for i in range(40)]  # one per second
    got = step_trace(base, 10.0)
    assert [r.arrival_s for r in got[:10]] == [float(i) for i in range(10)]
    # the next 20 s of trace arrive in 10 s: two per second from t = 10
    assert [r.arrival_s for r in got[10:]] == [10.0 + i / 2 for i in range(20)]
    assert len({r.index for r in got}) == len(got) == 30


def _row(t: float, load: float) -> dict:
    return {"t_s": t, "instances_needed:p": float(-(-load // 1)), "load_instances:p": load}


def test_step_response_reads_levels_and_delays() -> None:
    # load 1.0 until the step at 20 s, then ramps over a 5 s window to 2.0
    rows = [_row(float(t), 1.0) for t in range(20)]
    rows += [_row(20.0 + t + 0.5, min(2.0, 1.0 + 0.2 * (t + 1))) for t in range(20)]
    rounds = [{"t_s": r["t_s"] - 0.3, "load_instances:p": r["load_instances:p"]} for r in rows]
    got = step_response(rows, "p", 20.0, 5.0, rounds)
    assert got["load_before"] == 1.0 and got["load_after"] == 2.0
    assert got["needed_before"] == 1.0 and got["needed_after"] == 2.0
    assert got["first_round_after_s"] == 0.2  # the gateway's round at 20.2 s
    assert got["moved_after_s"] == 0.2  # ... already above the last round before the step
    assert got["reached_90pct_after_s"] == 4.5  # 1.0 + 0.2 * 5 = 2.0 >= 1.9
    assert step_response(rows[:5], "p", 20.0, 5.0, [])["error"] == "not enough samples"


def test_tracking_finds_the_delay_of_a_gauge() -> None:
    # bursty arrivals; a gauge that counts the last 5 s of them one second late
    rng = random.Random(1)
    arrivals = sorted([float(t) for t in range(60) for _ in range(rng.randint(0, 6))])
    rounds = [
        {"t_s": t + 0.5, "load_instances:p": float(sum(t - 6 < a <= t - 1 for a in arrivals))}
        for t in range(60)
    ]
    got = tracking(rounds, arrivals, "p", 5.0)
    assert got["best_lag_s"] in (0.75, 1.0, 1.25)  # the same whole-second arrivals
    assert got["corr_at_best"] == 1.0 > got["corr_lag_0"]
