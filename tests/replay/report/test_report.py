from __future__ import annotations

import json
import math

import pytest

from replay.report.report import (
    REQUIRED_KEYS,
    format_table,
    load_timeline,
    oscillation,
    summarize,
    weighted_percentile,
    write_json,
)
from replay.report.results import LoadSample, Outcome, RequestOutcome, RunResult

C, R, RAP, F = (
    Outcome.COMPLETED,
    Outcome.REJECTED,
    Outcome.REJECTED_AFTER_PREFILL,
    Outcome.FAILED,
)


def req(i: int, arrival: float, outcome: Outcome, **kw: object) -> RequestOutcome:
    kw.setdefault("prompt_tokens", 100)
    kw.setdefault("output_tokens", 10)
    return RequestOutcome(request_id=f"r{i}", arrival_s=arrival, outcome=outcome, **kw)


def sample_run(label: str = "kvcache_centric+predictive", *, steps: bool = True) -> RunResult:
    """9 requests with hand-checkable numbers (TTFT SLO 2 s, TBT SLO 0.1 s, 100 s trace)."""
    requests = [
        # meets both SLOs
        req(1, 0.0, C, prefill_instance="p0", cached_tokens=50, ttft_s=0.5, tbt_mean_s=0.05,
            generated=11),
        req(2, 5.0, C, prompt_tokens=200, prefill_instance="p0", ttft_s=1.0, tbt_mean_s=0.08,
            generated=5),
        # misses the TTFT SLO
        req(3, 12.0, C, prefill_instance="p1", cached_tokens=100, ttft_s=3.0, tbt_mean_s=0.05,
            generated=1),
        # misses the TBT SLO
        req(4, 15.0, C, prefill_instance="p1", ttft_s=1.5, tbt_mean_s=0.2, generated=3),
        req(5, 20.0, R, prompt_tokens=300, reason="ttft_slo"),
        req(6, 25.0, R, reason="ttft_slo"),
        req(7, 30.0, RAP, reason="tbt_slo", prefill_instance="p0", cached_tokens=20, ttft_s=0.7),
        # prefilled but failed: not in the cache hit ratio
        req(8, 35.0, F, reason="engine error", prompt_tokens=1000, cached_tokens=1000,
            prefill_instance="p0"),
        req(9, 40.0, R),
    ]  # fmt: skip
    load = [
        LoadSample(1.0, "p0", "prefill", 2, 2.0, 0, 0.0),
        LoadSample(2.0, "p1", "prefill", 4, 4.0, 0, 0.0),
        LoadSample(1.0, "d0", "decode", 0, 0.0, 10, 0.05),
        LoadSample(3.0, "d1", "decode", 0, 0.0, 20, 0.15),
        LoadSample(15.0, "c0", "both", 1, 1.0, 4, 0.02),
    ]
    return RunResult(
        label=label,
        policy="kvcache_centric",
        admission="predictive",
        ttft_slo_s=2.0,
        tbt_slo_s=0.1,
        duration_s=100.0,
        wall_s=4.0,
        requests=requests,
        load=load,
        tbt_steps=[(0.05, 10), (0.02, 5), (0.2, 1), (0.08, 4)] if steps else [],
        transferred_bytes=1e6,
        kv_transfer_bytes=2e6,
        replication_commands=3,
        replicated_bytes=5e5,
        extra={"seed": 7, "requests": 999, "bad": float("nan")},
    )


def empty_run(duration_s: float = 0.0) -> RunResult:
    return RunResult("empty", "random", "none", 2.0, 0.1, duration_s)


def test_counts_and_rates() -> None:
    s = summarize(sample_run())
    assert (s["label"], s["policy"], s["admission"]) == (
        "kvcache_centric+predictive",
        "kvcache_centric",
        "predictive",
    )
    assert s["requests"] == 9
    assert s["rejected"] == 3
    assert s["admitted"] == 6
    assert s["rejected_after_prefill"] == 1
    assert s["completed"] == 4
    assert s["failed"] == 1
    assert s["slo_met"] == 2
    assert s["goodput_rps"] == pytest.approx(2 / 100)
    assert s["throughput_rps"] == pytest.approx(4 / 100)
    assert s["slo_attainment"] == pytest.approx(2 / 9)
    assert s["wasted_prefill_ratio"] == pytest.approx(1 / 6)
    assert s["rejections_by_reason"] == {
        "after_prefill:tbt_slo": 1,
        "before_prefill:ttft_slo": 2,
        "before_prefill:unknown": 1,
    }
    assert s["wall_s"] == 4.0
    assert s["duration_s"] == 100.0
    assert s["sim_speedup"] == pytest.approx(25.0)
    assert s["requests_per_wall_s"] == pytest.approx(9 / 4)
    assert (s["ttft_slo_s"], s["tbt_slo_s"]) == (2.0, 0.1)
    assert s["transferred_bytes"] == 1e6
    assert s["kv_transfer_bytes"] == 2e6
    assert s["replication_commands"] == 3
    assert s["replicated_bytes"] == 5e5


def test_best_effort_admissions_are_counted_apart() -> None:
    run = sample_run()
    s = summarize(run)
    assert (s["best_effort_admitted"], s["best_effort_slo_met"]) == (0, 0)
    assert s["promised_slo_miss_ratio"] == s["admitted_slo_miss_ratio"] == pytest.approx(4 / 6)
    run.requests[2].best_effort = True  # r3: served late, missed its TTFT (as predicted)
    run.requests[0].best_effort = True  # r1: served late, made it anyway
    s = summarize(run)
    assert (s["best_effort_admitted"], s["best_effort_slo_met"]) == (2, 1)
    assert s["admitted_slo_miss_ratio"] == pytest.approx(4 / 6)  # every admitted request
    assert s["promised_slo_miss_ratio"] == pytest.approx(3 / 4)  # 4 promised, only r2 met


def test_ttft_stats_over_completed_only() -> None:
    s = summarize(sample_run())
    # completed TTFTs sorted: 0.5, 1.0, 1.5, 3.0 (0.7 of the rejected-after-prefill excluded)
    assert s["ttft_mean_s"] == pytest.approx(1.5)
    assert s["ttft_p50_s"] == pytest.approx(1.0)  # rank ceil(0.5 * 4) = 2
    assert s["ttft_p90_s"] == pytest.approx(3.0)  # rank ceil(3.6) = 4
    assert s["ttft_p99_s"] == pytest.approx(3.0)


def test_tbt_token_weighted_from_steps() -> None:
    s = summarize(sample_run())
    # sorted: 0.02 x5, 0.05 x10, 0.08 x4, 0.2 x1 -> cumulative 5, 15, 19, 20
    assert s["tbt_source"] == "steps"
    assert s["tbt_p50_s"] == pytest.approx(0.05)  # 10 <= 15
    assert s["tbt_p99_s"] == pytest.approx(0.2)  # 19.8 > 19
    assert s["tbt_mean_s"] == pytest.approx((0.1 + 0.5 + 0.32 + 0.2) / 20)


def test_tbt_falls_back_to_request_means() -> None:
    s = summarize(sample_run(steps=False))
    # weights max(generated - 1, 1): 0.05 x10 (r1), 0.08 x4 (r2), 0.05 x1 (r3), 0.2 x2 (r4)
    # sorted cumulative: 0.05 -> 11, 0.08 -> 15, 0.2 -> 17
    assert s["tbt_source"] == "requests"
    assert s["tbt_p50_s"] == pytest.approx(0.05)  # 8.5 <= 11
    assert s["tbt_p99_s"] == pytest.approx(0.2)  # 16.83 > 15
    assert s["tbt_mean_s"] == pytest.approx((0.5 + 0.32 + 0.05 + 0.4) / 17)


def test_weighted_percentile_uses_weights() -> None:
    values, weights = [0.01, 0.05], [1, 9]
    assert weighted_percentile(values, weights, 0.5) == 0.05
    assert weighted_percentile(values, weights, 0.1) == 0.01
    assert weighted_percentile(values, [1, 1], 0.5) == 0.01
    assert weighted_percentile([3.0, 1.0, 2.0], [1, 1, 1], 1.0) == 3.0
    assert weighted_percentile([3.0, 1.0, 2.0], [1, 1, 1], 0.0) == 1.0
    assert weighted_percentile(list(range(1, 11)), [1] * 10, 0.9) == 9  # no float drift
    assert weighted_percentile([], [], 0.5) is None
    assert weighted_percentile([1.0], [0], 0.5) is None


def test_cache_hit_ratio_over_prefilled_requests() -> None:
    s = summarize(sample_run())
    # r1, r2, r3, r4, r7: cached 50 + 0 + 100 + 0 + 20 over prompts 100 + 200 + 100 * 3
    assert s["cache_hit_ratio"] == pytest.approx(170 / 600)


def test_extra_copied_without_overriding_and_nan_free() -> None:
    s = summarize(sample_run())
    assert s["seed"] == 7
    assert s["requests"] == 9
    assert s["bad"] is None
    json.dumps(s, allow_nan=False)


@pytest.mark.parametrize("duration", [0.0, 50.0])
def test_empty_run(duration: float) -> None:
    s = summarize(empty_run(duration))
    for key in ("requests", "admitted", "rejected", "rejected_after_prefill", "completed"):
        assert s[key] == 0
    for key in (
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "tbt_p50_s",
        "tbt_p99_s",
        "slo_attainment",
        "cache_hit_ratio",
        "wasted_prefill_ratio",
        "sim_speedup",
        "requests_per_wall_s",
        "decode_load_oscillation",
    ):
        assert s[key] is None, key
    assert s["goodput_rps"] == (0.0 if duration else None)
    assert s["rejections_by_reason"] == {}
    json.dumps(s, allow_nan=False)


def test_load_timeline() -> None:
    tl = load_timeline(sample_run(), 10.0)
    assert tl["t_s"] == [10.0 * i for i in range(10)]
    assert tl["prefill_queue_s"][:2] == pytest.approx([3.0, 1.0])  # role "both" counts
    assert tl["prefill_queued"][:2] == pytest.approx([3.0, 1.0])
    assert tl["decode_batch"][:2] == pytest.approx([15.0, 4.0])
    assert tl["decode_load"][:2] == pytest.approx([1.0, 0.2])  # (0.5 + 1.5) / 2, 0.02 / 0.1
    assert tl["prefill_queue_s"][2:] == [None] * 8
    assert tl["decode_load"][2:] == [None] * 8
    assert tl["arrivals"] == [2, 2, 2, 2, 1, 0, 0, 0, 0, 0]
    assert tl["admitted"] == [2, 2, 0, 2, 0, 0, 0, 0, 0, 0]
    assert tl["rejected"] == [0, 0, 2, 0, 1, 0, 0, 0, 0, 0]
    assert tl["rejected_after_prefill"] == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert sum(tl["admitted"]) + sum(tl["rejected"]) == 9


def test_load_timeline_edges() -> None:
    assert load_timeline(empty_run(), 10.0)["t_s"] == []
    run = empty_run(20.0)
    run.requests = [req(1, 20.0, C), req(2, -1.0, R)]  # end clips to last, negative to first
    tl = load_timeline(run, 10.0)
    assert tl["arrivals"] == [1, 1]
    assert tl["rejected"] == [1, 0]
    with pytest.raises(ValueError):
        load_timeline(run, 0.0)


def test_oscillation() -> None:
    assert oscillation([3.0, 3.0, 3.0, 3.0]) == 0.0
    assert oscillation([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]) == pytest.approx(2.0)
    assert oscillation([1.0, 2.0, 3.0, 4.0]) == pytest.approx(1 / 2.5)  # a ramp is small
    assert oscillation([1.0, None, 1.0, float("nan")]) == 0.0
    assert oscillation([]) == 0.0
    assert oscillation([5.0]) == 0.0
    assert oscillation([0.0, 0.0]) == 0.0
    # damping: a decaying oscillation scores lower than a sustained one
    sustained = [1.0 + (-1) ** i * 0.8 for i in range(20)]
    damped = [1.0 + (-1) ** i * 0.8 * 0.7**i for i in range(20)]
    assert oscillation(damped) < oscillation(sustained) / 3


def test_summary_load_oscillation() -> None:
    s = summarize(sample_run())
    # decode load per bucket: 1.0, 0.2 (others empty) -> |0.8| / 0.6
    assert s["decode_load_oscillation"] == pytest.approx(0.8 / 0.6)
    assert s["prefill_load_oscillation"] == pytest.approx(2.0 / 2.0)


def test_format_table() -> None:
    rows = [summarize(sample_run()), summarize(empty_run())]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("label")
    for col in ("goodput", "SLO %", "TTFT", "TBT p50 ms", "cache %", "wall s"):
        assert col in lines[0]
    assert lines[2].startswith("kvcache_centric+predictive")
    assert lines[3].startswith("empty")
    cells = lines[2].split()
    assert cells[1:5] == ["9", "6", "3", "1"]
    assert "0.02" in cells  # goodput
    assert "22.2" in cells  # SLO attainment %
    assert "50.0" in cells  # TBT p50 in ms
    assert "28.3" in cells  # cache hit %
    assert "-" in lines[3].split()
    assert format_table([]).count("\n") == 1  # header and separator only


def test_write_json_round_trip(tmp_path) -> None:
    rows = [summarize(sample_run()), summarize(empty_run())]
    path = write_json(tmp_path / "a" / "b" / "summary.json", rows, extra={"trace": "x.jsonl"})
    data = json.loads(path.read_text())
    assert data["trace"] == "x.jsonl"
    assert [r["label"] for r in data["runs"]] == ["kvcache_centric+predictive", "empty"]
    for key in REQUIRED_KEYS:
        assert key in data["runs"][0] and key in data["runs"][1], key
    assert data["runs"][0]["cache_hit_ratio"] == pytest.approx(170 / 600)
    assert data["runs"][1]["ttft_p50_s"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in data["runs"][0].values())
