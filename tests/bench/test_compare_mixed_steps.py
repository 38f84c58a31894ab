"""bench.compare_mixed_steps on the committed H200 mixed-step runs (docs/gpu-step-times.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare_gpu_profile import build_rows
from bench.compare_mixed_steps import U3, InputError, Step, fit_u3, load_steps, main, mape

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"
RUNS = ("gpu-mixed-steps-h200.json", "gpu-mixed-steps-h200-run2.json")


def test_u3_fitted_on_pure_steps_predicts_the_mixed_ones(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    assert main([*(str(DATA / r) for r in RUNS), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results) == 2
    for result in results.values():
        assert result["steps"] == {"prefill": 6, "decode": 4, "mixed": 24}
        pure = result["u3_fit_on_pure_steps"]
        assert pure["mape_pure_pct"] < 3.0 and pure["mape_mixed_pct"] < 7.0  # the doc's numbers
        # mixing pays the fixed cost once: every mixed step is cheaper than its halves apart
        assert result["mixed_over_apart"]["max"] < 1.0
        assert len(result["pairs"]) == 24


def test_fit_recovers_a_known_u3() -> None:
    known = U3(a=4.0, b=0.02, t0=128, c=2e-6, k=3e-5)
    steps = [
        Step(kind, n, c, b, k, 0.0)
        for kind, n, c, b, k in [
            ("prefill", 256, 0, 0, 0), ("prefill", 2048, 4096, 0, 0), ("prefill", 1024, 0, 0, 0),
            ("decode", 0, 0, 8, 4096), ("decode", 0, 0, 128, 2048), ("decode", 0, 0, 32, 512),
            ("mixed", 512, 1024, 16, 2048), ("mixed", 64, 0, 4, 256),
        ]
    ]  # fmt: skip
    steps = [Step(s.kind, s.chunk, s.cached, s.batch, s.context, known.ms(s)) for s in steps]
    fitted = fit_u3(steps)
    assert fitted.t0 == 128 and mape(fitted, steps) < 1e-6
    assert fitted.c == pytest.approx(2e-6, rel=1e-6) and fitted.k == pytest.approx(3e-5, rel=1e-6)


def test_a_steps_file_without_mixed_steps_is_a_clear_error(tmp_path: Path, capsys) -> None:
    with pytest.raises(InputError, match="no mixed steps"):
        load_steps(DATA / "gpu-engine-steps-h200.json")
    assert main([str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err


def test_the_profile_comparison_leaves_mixed_steps_out() -> None:
    points = json.loads((DATA / RUNS[0]).read_text())["points"]
    rows = build_rows(points, "llama3-8b-h100-tp1")
    assert len(rows) == 10 and {r.kind for r in rows} == {"prefill", "decode"}
