"""bench.compare_gpu_profile on the two committed H100 step-time files: the HF eager run and the
engine-like CUDA-graph run (docs/gpu-step-times.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare_gpu_profile import InputError, load_points, main

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


def run(tmp_path: Path, steps: str) -> dict:
    out = tmp_path / "cmp.json"
    assert main(["--steps", str(DATA / steps), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_engine_run_is_labelled_graph_and_fits_the_decode_form(tmp_path: Path) -> None:
    result = run(tmp_path, "gpu-engine-steps.json")
    assert result["e2e_label"] == "graph"
    assert "decode_kernels_minus_cat" not in result["fits"]  # the cache is written in place
    decode = result["fits"]["decode_graph"]
    assert decode["points"] == 13 and decode["mape_pct"] < 5.0
    ratios = [r["graph_over_kvgate"] for r in result["rows"] if r["kind"] == "decode"]
    assert min(ratios) > 0.9 and max(ratios) < 1.25  # what docs/gpu-step-times.md states


def test_hf_run_keeps_its_eager_label_and_cache_copy_fit(tmp_path: Path) -> None:
    result = run(tmp_path, "gpu-step-times.json")
    assert result["e2e_label"] == "eager"
    assert result["fits"]["decode_kernels_minus_cat"]["points"] > 3
    assert all("eager_over_kvgate" in r for r in result["rows"])


def test_a_file_without_points_is_a_clear_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "steps.json"
    bad.write_text('{"meta": {}}')
    with pytest.raises(InputError, match="no 'points' list"):
        load_points(bad)
    assert main(["--steps", str(bad)]) == 2
    assert "steps.json" in capsys.readouterr().err
