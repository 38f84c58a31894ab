"""The rejection-path benchmark: its stages add up, the hopeless path skips the prompt work, and
the live probe's summary splits latencies by path."""

from __future__ import annotations

import asyncio

import pytest

from bench.rejection_path import KINDS, main, probe_summary, run


def test_in_process_stages_for_each_prompt_kind() -> None:
    res = asyncio.run(run(requests=3, reps=1, tokens=256, model_dir=None))
    assert set(res["kinds"]) == set(KINDS)
    for kind, r in res["kinds"].items():
        assert 200 <= r["prompt_tokens"] <= 320, kind  # ~256 tokens each
        full, fast = r["full"], r["hopeless"]
        assert set(full) == {
            "body_read",
            "json_parse",
            "tokenize",
            "block_hash",
            "schedule",
            "answer",
            "total",
        }
        assert set(fast) == {"body_read", "json_parse", "check", "answer", "total"}
        assert all(v["p50"] > 0 and v["p99"] >= v["p50"] for v in full.values())
        # The stages are measured back to back: their sum is the total (rounding aside).
        parts = sum(v["p50"] for k, v in full.items() if k != "total")
        assert parts == pytest.approx(full["total"]["p50"], rel=0.5)
        assert r["handler_full"]["total"]["p50"] > 0 < r["handler_hopeless"]["total"]["p50"]


def test_probe_summary_splits_by_path() -> None:
    rows = [
        [0.0, 1.0, 429, "ttft_slo", True],
        [0.1, 3.0, 429, "ttft_slo", True],
        [0.2, 9.0, 429, "ttft_slo", False],
        [0.3, None, None, "client_error", False],
        [0.4, 50.0, 200, None, False],  # admitted: not a rejection
    ]
    s = probe_summary(rows)
    assert (s["sent"], s["rejected"], s["other"]) == (5, 3, 2)
    assert s["by_reason"] == {"ttft_slo": 3}
    assert s["hopeless"]["n"] == 2 and s["hopeless"]["p50"] in (1.0, 3.0)
    assert s["full"] == {"n": 1, "p50": 9.0, "p90": 9.0, "p99": 9.0}
    assert s["all"]["n"] == 3 and s["all"]["p99"] == 9.0
    assert probe_summary([])["all"]["p50"] is None


def test_cli_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        main(["--requests", "0"])
