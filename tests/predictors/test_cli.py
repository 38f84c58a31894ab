from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from backends.predictor_files import load_learned_prefill
from backends.predictors_cli import add_arguments, main, run_eval, run_train
from tests.predictors.testdata import write_grid_csv

REQUIRED_KEYS = {
    "config",
    "rows",
    "holdout_rows",
    "mape_learned_pct",
    "mape_compiled_pct",
    "mape_analytic_pct",
    "compiled_vs_booster_max_pct",
}
TWO = {"Llama-3-8B/H100/TP1": "llama3-8b-h100-tp1", "Llama-2-70B/A100/TP8": "llama2-70b-a100-tp8"}


@pytest.fixture
def grid_csv(tmp_path: Path) -> Path:
    return write_grid_csv(tmp_path / "grid.csv", TWO)


def test_add_arguments_registers_train_and_eval() -> None:
    parser = argparse.ArgumentParser(prog="kvgate")
    top = parser.add_subparsers(dest="cmd")
    add_arguments(top.add_parser("predictors").add_subparsers(dest="sub", required=True))
    args = parser.parse_args(["predictors", "train", "--samples", "s.csv", "--out", "m.json"])
    assert args.func is run_train and args.seed == 0 and args.holdout == 0.2
    args = parser.parse_args(["predictors", "eval", "--samples", "s.csv", "--all-configs"])
    assert args.func is run_eval and args.all_configs and not args.json


def test_train_then_eval_saved_model(
    grid_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.json"
    cfg = "Llama-3-8B/H100/TP1"
    assert main(["train", "--samples", str(grid_csv), "--config", cfg, "--out", str(out)]) == 0
    assert "mape_learned=" in capsys.readouterr().out
    assert load_learned_prefill(out).meta.config == cfg
    rc = main(["eval", "--samples", str(grid_csv), "--config", cfg, "--model", str(out), "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= REQUIRED_KEYS
    assert result["config"] == cfg and result["rows"] == 96 and result["holdout_rows"] == 19
    assert result["mape_learned_pct"] < 5.0
    assert result["compiled_vs_booster_max_pct"] <= 1.0
    # Synthetic data = P5 × ±4 % wiggle, so the analytic prior is a few % off.
    assert 0.5 < result["mape_analytic_pct"] < 5.0


def test_eval_trains_when_no_model(grid_csv: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval", "--samples", str(grid_csv), "--config", "Llama-2-70B/A100/TP8", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["profile"] == "llama2-70b-a100-tp8"
    assert result["mape_learned_pct"] < 5.0


def test_eval_all_configs_table_and_json(
    grid_csv: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", "--samples", str(grid_csv), "--all-configs"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("config") and len(out) == 3
    assert out[1].startswith("Llama-3-8B/H100/TP1") and out[2].startswith("Llama-2-70B/A100/TP8")
    assert main(["eval", "--samples", str(grid_csv), "--all-configs", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["config"] for r in results] == list(TWO)
    assert all(set(r) >= REQUIRED_KEYS for r in results)


def test_observed_samples_without_profile_have_no_analytic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        f"{n},{c},{0.001 + n * 2e-5 + n * c * 1e-9}" for n in range(50, 2000, 50) for c in (0, 512)
    ]
    p = tmp_path / "obs.csv"
    p.write_text("new_tokens,cached_tokens,prefill_s\n" + "\n".join(rows) + "\n")
    assert main(["eval", "--samples", str(p), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"] is None and result["mape_analytic_pct"] is None
    assert main(["eval", "--samples", str(p), "--profile", "llama3-8b-h100-tp1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mape_analytic_pct"] is not None


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate predictors: error:") and needle in err
    assert "Traceback" not in err


def test_errors_exit_2_without_traceback(
    grid_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    g = str(grid_csv)
    cfg = ["--config", "Llama-3-8B/H100/TP1"]
    out = ["--out", str(tmp_path / "o.json")]
    _fails(["eval", "--samples", str(tmp_path / "none.csv"), "--config", "x"], capsys, "none.csv")
    _fails(["eval", "--samples", g, "--config", "Nope/H100/TP1"], capsys, "unknown config")
    _fails(["eval", "--samples", g], capsys, "several configs")
    _fails(["eval", "--samples", g, *cfg, "--profile", "x"], capsys, "known profiles")
    _fails(["eval", "--samples", g, "--all-configs", "--model", "m.json"], capsys, "--all-configs")
    _fails(["eval", "--samples", g, *cfg, "--model", g], capsys, "not a kvgate prefill model")
    bad = tmp_path / "bad.csv"
    bad.write_text("config,n_new,n_cached,gpu_ms\nA,16,0,1.0\nA,sixteen,0,1.0\n")
    _fails(["train", "--samples", str(bad), *out], capsys, f"{bad}:3:")
    _fails(["train", "--samples", g, *cfg, *out, "--holdout", "1.5"], capsys, "holdout")


def test_real_grid_eval(prefill_grid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["eval", "--samples", str(prefill_grid), "--config", "Llama-3-8B/H100/TP1", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == 142 and result["holdout_rows"] == 28
    assert result["mape_learned_pct"] <= 5.0
    assert result["mape_analytic_pct"] == pytest.approx(3.5, abs=1.0)
