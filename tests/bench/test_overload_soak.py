"""Smoke runs of the overload and soak benchmarks on a tiny emulated fleet (seconds, not minutes),
plus the pure parts: the phased workload and the RSS-growth arithmetic."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.emulated_fleet import EmulatedFleet, rss_kb
from bench.overload_report import Phase, PhaseRun, Sample, kv_index_flat, rss_growth
from bench.overload_soak import fleet_spec, parse_args, run_mode
from bench.phase_load import phase_trace

BASE_PORT = 18580  # h4's range: the real runs use 18500-18549, the dev smoke runs 18550
TINY = ["--input-tokens", "256", "--output-tokens", "4", "--rate-1x", "3", "--sample-s", "0.5"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    args = parse_args(["soak", *TINY, "--base-port", str(BASE_PORT)])
    with EmulatedFleet(fleet_spec(args, tmp_path_factory.mktemp("fleet"))) as running:
        yield running
    assert running.gateway is not None and running.gateway.poll() is not None  # ended


def test_overload_smoke(fleet: EmulatedFleet) -> None:
    args = parse_args(["overload", *TINY, "--seconds", "3", "--reject-probe"])
    rep = asyncio.run(run_mode(fleet, args))
    one, three = rep["phases"]
    # The probe's 4k-token requests with a 1 ms TTFT SLO are all rejected, by either path.
    for phase in (one, three):
        pr = phase["reject_probe_ms"]
        assert pr["sent"] >= 5 and pr["rejected"] == pr["sent"], pr
        assert pr["hopeless"]["n"] + pr["full"]["n"] == pr["rejected"]
        assert 0 < pr["all"]["p50"] <= pr["all"]["p99"]
    assert (one["phase"], three["phase"]) == ("1x", "3x")
    assert three["rate_rps"] == pytest.approx(3 * one["rate_rps"])
    assert one["requests"] > 0 and three["requests"] > one["requests"]
    assert one["failed"] == 0 and three["failed"] == 0
    assert one["goodput_rps"] > 0 and 0 <= one["slo_attainment"] <= 1
    assert rep["goodput_ratio_3x_1x"] == pytest.approx(
        three["goodput_rps"] / one["goodput_rps"], abs=1e-3
    )
    rej = three["reject_ms"]
    assert rej["n"] == three["rejected"]
    if rej["n"]:
        assert 0 < rej["p50"] <= rej["p99"] <= rej["max"]
    assert set(rep["targets_met"]) == {
        "goodput_ratio_ge_0.9",
        "reject_p99_le_5ms",
        "books_at_zero",
    }
    # The target is judged on the probe's view (its own idle client) when the probe ran.
    assert rep["reject_p99_ms"] == {
        "value": three["reject_probe_ms"]["all"]["p99"],
        "source": "probe",
    }
    assert rep["books_end"]["requests_in_flight"] == 0
    assert rep["books_end"]["decision_history"] <= rep["recent_decisions_bound"]
    assert rep["gateway_tracebacks"] == 0
    assert one["health_ms_gateway"]["n"] > 0 and one["health_ms_engine"]["p50"] > 0


def test_soak_smoke(fleet: EmulatedFleet) -> None:
    args = parse_args(["soak", *TINY, "--seconds", "4"])
    rep = asyncio.run(run_mode(fleet, args))
    (phase,) = rep["phases"]
    assert phase["requests"] > 0 and phase["completed"] > 0
    samples = rep["samples"]
    assert len(samples["t_s"]) >= 5  # every 0.5 s over 4 s, plus the drain
    assert all(kb and 20_000 < kb < 2_000_000 for kb in samples["rss_kb"])  # KiB: 20 MB-2 GB
    assert samples["t_s"] == sorted(samples["t_s"])
    growth = rep["rss_growth"]
    assert growth["baseline_kb"] > 0 and growth["growth_pct"] is not None
    # 4 s cannot fill a 4,000-observation learner window: the warm-up is not over, and the
    # growth is judged after the first 20 % (filling included).
    assert growth["warmup_over"] is False
    assert growth["growth_pct"] == growth["fixed_20pct"]["growth_pct"]
    assert rep["targets_met"]["rss_growth_le_5pct"] is (growth["growth_pct"] <= 5.0)
    assert rep["books_over_time"]["decision_history_max"] <= fleet.spec.recent_decisions
    assert rep["books_end"]["requests_in_flight"] == 0
    assert rep["books_end"]["history_in_flight"] == 0
    assert rep["targets_met"]["books_at_zero"] is True
    assert rep["targets_met"]["decision_history_bounded"] is True


def test_phase_trace_keeps_phases_apart() -> None:
    phases = [Phase("1x", 5.0, 10.0), Phase("3x", 15.0, 10.0)]
    trace = phase_trace(phases, input_tokens=512, output_tokens=8, seed=1)
    arrivals = [tr.arrival_s for _, tr in trace]
    assert arrivals == sorted(arrivals)
    assert [tr.index for _, tr in trace] == list(range(len(trace)))
    first = {h for k, tr in trace if k == 0 for h in tr.hash_ids}
    second = {h for k, tr in trace if k == 1 for h in tr.hash_ids}
    assert first and second and not first & second  # no prefix shared across phases
    assert all(tr.arrival_s >= 10.0 for k, tr in trace if k == 1)
    n0 = sum(1 for k, _ in trace if k == 0)
    assert 20 < n0 < 90 and 2 * n0 < len(trace) - n0 < 5 * n0  # ~50 vs ~150 requests


def test_rss_growth_skips_the_warm_up() -> None:
    run = PhaseRun([Phase("1x", 1.0, 100.0)], [[]], [[]])
    kbs = [50_000, 90_000, 100_000, 101_000, 102_000, 103_000]  # the first two are warm-up
    run.samples = [
        Sample(t, kb, None, 0.0, None, 0)
        for t, kb in zip([0, 10, 20, 50, 80, 99], kbs, strict=True)
    ]
    g = rss_growth(run, total_s=100.0, decision_bound=10)
    assert g["baseline_kb"] == 100_000 and g["end_kb"] == 103_000
    assert g["growth_pct"] == pytest.approx(3.0)
    # No books: the structures were never seen full, so the warm-up is not known to be over.
    assert g["warmup_over"] is False and g["filled_at_s"] is None


def test_rss_growth_waits_for_the_bounded_structures() -> None:
    """The warm-up lasts until the decision history and the learner's window are full."""
    run = PhaseRun([Phase("1x", 1.0, 100.0)], [[]], [[]])
    fills = [(2, 0), (10, 40), (10, 90), (10, 100), (10, 100), (10, 100)]  # (history, learner)
    kbs = [50_000, 90_000, 100_000, 101_000, 102_000, 103_000]
    run.samples = [
        Sample(
            t,
            kb,
            None,
            0.0,
            {"decision_history": h, "learner_samples": n, "learner_window": 100},
            0,
        )
        for t, kb, (h, n) in zip([0, 10, 20, 50, 80, 99], kbs, fills, strict=True)
    ]
    g = rss_growth(run, total_s=100.0, decision_bound=10)
    assert g["warmup_over"] is True and g["filled_at_s"] == 50
    assert g["baseline_kb"] == 101_000 and g["growth_pct"] == pytest.approx(1.98)
    assert g["fixed_20pct"]["baseline_kb"] == 100_000  # the 20 % alone, for comparison


def test_kv_index_flat_needs_a_plateau() -> None:
    def run_with(sizes: list[int]) -> PhaseRun:
        run = PhaseRun([Phase("1x", 1.0, 100.0)], [[]], [[]])
        books = [{"kv_index_blocks": n} for n in sizes]
        run.samples = [Sample(10.0 * i, 1, None, 0.0, b, 0) for i, b in enumerate(books)]
        return run

    assert kv_index_flat(run_with([500, 1000, 1000, 1010, 990, 1000]), 60.0)
    assert not kv_index_flat(run_with([100, 200, 300, 400, 500, 600]), 60.0)


def test_bad_arguments_exit_2() -> None:
    for bad in (["soak", "--seconds", "0"], ["overload", "--rate-1x", "-1"], ["nope"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(bad)
        assert exc.value.code == 2


def test_rss_of_a_missing_process_is_none(tmp_path: Path) -> None:
    assert rss_kb(2**22 + 12345) is None  # above the default pid_max
