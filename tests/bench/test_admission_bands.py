"""bench/admission_bands.py: per-band shares from real outcomes, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

from bench.admission_bands import band_shares, main
from replay.report.results import Outcome, RequestOutcome
from replay.workload.synthetic import chat_spec, generate, write_mooncake


def _outcome(i: int, tokens: int, outcome: Outcome) -> RequestOutcome:
    o = RequestOutcome(f"r{i}", 0.0, tokens, 10, outcome)
    if outcome is Outcome.COMPLETED:
        o.ttft_s, o.tbt_mean_s = 1.0, 0.05
    return o


def test_bands_split_by_prompt_rank_and_count_admitted_and_met() -> None:
    # 100 requests, 1..100 tokens; the longest 20 rejected, one admitted one failed.
    reqs = [
        _outcome(i, i, Outcome.REJECTED if i > 80 else Outcome.COMPLETED) for i in range(1, 101)
    ]
    reqs[10].outcome = Outcome.FAILED
    rows = band_shares(reqs, ttft_slo_s=5.0, tbt_slo_s=0.1)
    assert [r["requests"] for r in rows] == [50, 30, 10, 5, 4, 1]
    assert rows[0]["tokens"] == [1, 50] and rows[-1]["tokens"] == [100, 100]
    assert rows[0]["admitted"] == 1.0 and rows[0]["slo_met"] == 0.98
    assert rows[1]["admitted"] == 1.0 and rows[2]["admitted"] == 0.0


def test_cli_runs_both_settings_and_writes_json(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "chat.jsonl"
    write_mooncake(generate(chat_spec(requests=120, rate_rps=20.0, seed=1)), trace)
    out = tmp_path / "bands.json"
    args = [str(trace), "--prefill", "2", "--decode", "1", "--profile", "llama3-8b-h100-tp1"]
    args += ["--tbt-slo", "0.01", "--admission", "early", "--json", str(out)]
    assert main(args) == 0
    off, on = json.loads(out.read_text())["runs"]
    assert off["reserve_turned_away"] == 0 and on["reserve_turned_away"] > 0
    assert sum(b["requests"] for b in on["bands"]) == 120
    assert "reservation off" in capsys.readouterr().out
