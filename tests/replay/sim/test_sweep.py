"""``kvgate sim sweep``: every point runs every entry, next to a bound none of them exceeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from predictors.profiles import get_profile
from replay.sim.upper_bound import goodput_bound
from replay.workload.synthetic import chat_spec, generate, write_mooncake
from replay.workload.traces import load_mooncake, select


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    write_mooncake(generate(chat_spec(requests=150, rate_rps=20.0, seed=2)), path)
    return path


def test_sweep_writes_points_with_bound_and_plots(trace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sweep.json"
    rc = main(
        [
            "sim", "sweep", str(trace),
            "--prefill", "1", "--decode", "1", "--profile", "llama3-8b-h100-tp1",
            "--speeds", "1,8", "--ttft-slos", "1,5",
            "--compare", "kvcache_centric+early,round_robin+none",
            "--json", str(out), "--plots", str(tmp_path / "plots"), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(p["speed"], p["ttft_slo_s"]) for p in report["points"]] == [
        (1.0, 1.0), (1.0, 5.0), (8.0, 1.0), (8.0, 5.0)
    ]  # fmt: skip
    for point in report["points"]:
        bound = point["bound"]["goodput_rps"]
        assert [r["label"] for r in point["runs"]] == ["kvcache_centric+early", "round_robin+none"]
        for run in point["runs"]:
            assert run["goodput_rps"] <= bound + 1e-9
            assert 0 <= run["fraction_of_bound"] <= 1
    # More load, same SLO: the bound grows with the arrival rate until capacity binds.
    by = {(p["speed"], p["ttft_slo_s"]): p["bound"]["goodput_rps"] for p in report["points"]}
    assert by[(8.0, 5.0)] > by[(1.0, 5.0)]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "sweep_goodput_rps.png", "sweep_ttft_p90_s.png", "sweep_wasted_prefill_ratio.png"
    ]  # fmt: skip
    assert "of bound" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--speeds", "1,-2"], "--speeds"), (["--ttft-slos", "x"], "--ttft-slos")],
)
def test_bad_grid_exits_2_naming_the_option(trace: Path, capsys, args, needle) -> None:
    assert main(["sim", "sweep", str(trace), "--quiet", *args]) == 2
    assert needle in capsys.readouterr().err


def test_sweep_runs_each_entry_with_conditional_disagg_off_and_on(trace: Path, tmp_path) -> None:
    out = tmp_path / "cd.json"
    rc = main(
        [
            "sim", "sweep", str(trace),
            "--prefill", "1", "--decode", "1", "--profile", "llama3-8b-h100-tp1",
            "--speeds", "8", "--ttft-slos", "1", "--compare", "kvcache_centric+early",
            "--conditional-disagg", "both", "--json", str(out), "--quiet",
        ]
    )  # fmt: skip
    assert rc == 0
    (point,) = json.loads(out.read_text())["points"]
    off, on = point["runs"]
    assert (off["label"], on["label"]) == ("kvcache_centric+early", "kvcache_centric+early+cd")
    assert "local_prefills" not in off
    assert on["local_prefills"] > 0  # 8x load on one prefill instance: short prompts go local
    # Prefills on the decode instance: the bound's prefill side counts both instances, so no run
    # exceeds it; a bound on the prefill pool alone, one prompt per step, the cd run does.
    for run in (off, on):
        assert run["goodput_rps"] <= point["bound"]["goodput_rps"] + 1e-9
    pool_only = goodput_bound(
        select(load_mooncake(trace), speed=8.0),
        get_profile("llama3-8b-h100-tp1"),
        prefill_instances=1,
        decode_instances=1,
        ttft_slo_s=1.0,
        tbt_slo_s=0.1,
        overhead_ms=0.5,
        prefill_alone=True,
    )
    assert on["goodput_rps"] > pool_only.goodput_rps
