from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.predictor_files import load_compiled, load_learned_prefill, save_prefill_model
from predictors.grid import GridPrefill
from predictors.prefill import PrefillTimeModel
from predictors.prefill_learned import (
    FEATURES,
    MONOTONE,
    LearnedPrefill,
    TrainReport,
    holdout_split,
    train_prefill_model,
)
from predictors.samples import PrefillSamples
from tests.predictors.testdata import TARGET_CONFIGS, synthetic_samples

Trained = dict[str, tuple[PrefillSamples, LearnedPrefill, TrainReport]]


@pytest.mark.parametrize("config", TARGET_CONFIGS)
def test_held_out_mape_at_most_5_percent(trained: Trained, config: str) -> None:
    samples, model, report = trained[config]
    assert report.meta.holdout_rows == 28 and report.meta.train_rows == 114
    idx = report.holdout_index
    pred = model.predict_many(samples.new_tokens[idx], samples.cached_tokens[idx])
    mape = float(np.mean(np.abs(pred / samples.seconds[idx] - 1)) * 100)
    assert mape == pytest.approx(report.mape_learned_pct)
    assert mape <= 5.0
    assert report.mape_compiled_pct is not None and report.mape_compiled_pct <= 5.0
    assert model.meta.holdout_mape_pct == report.mape_learned_pct


@pytest.mark.parametrize("config", TARGET_CONFIGS)
@pytest.mark.parametrize("seed", [1, 2])
def test_held_out_mape_other_seeds(prefill_grid: Path, config: str, seed: int) -> None:
    from backends.predictor_files import load_prefill_samples

    _, report = train_prefill_model(load_prefill_samples(prefill_grid, config), seed=seed)
    assert report.mape_learned_pct is not None and report.mape_learned_pct <= 5.0


@pytest.mark.parametrize("config", TARGET_CONFIGS)
def test_compiled_grid_agrees_with_booster(trained: Trained, config: str) -> None:
    samples, model, report = trained[config]
    idx = report.holdout_index
    n, c = samples.new_tokens[idx], samples.cached_tokens[idx]
    booster = model.predict_many(n, c)
    compiled = np.array(
        [model.compiled.predict(a, b) for a, b in zip(n.tolist(), c.tolist(), strict=True)]
    )
    assert np.max(np.abs(compiled / booster - 1)) <= 0.01
    # Held-out sizes sit on knots; also check arbitrary sizes inside the training range.
    rng = np.random.default_rng(7)
    n = np.exp(rng.uniform(0, np.log(16384), 2000)).round()
    c = np.where(rng.random(2000) < 0.2, 0, rng.integers(0, 24576, 2000))
    booster = model.predict_many(n, c)
    compiled = np.array(
        [model.compiled.predict(a, b) for a, b in zip(n.tolist(), c.tolist(), strict=True)]
    )
    assert np.max(np.abs(compiled / booster - 1)) <= 0.01


@pytest.mark.parametrize("config", TARGET_CONFIGS)
def test_compiled_table_is_monotone(trained: Trained, config: str) -> None:
    assert trained[config][1].compiled.is_monotone_in_new_tokens()


@settings(max_examples=300, deadline=None)
@given(
    n1=st.integers(0, 300_000),
    n2=st.integers(0, 300_000),
    cached=st.integers(0, 300_000),
    config=st.sampled_from(TARGET_CONFIGS),
)
def test_compiled_monotone_in_new_tokens(
    trained: Trained, n1: int, n2: int, cached: int, config: str
) -> None:
    g = trained[config][1].compiled
    lo, hi = sorted((n1, n2))
    assert g.predict(lo, cached) <= g.predict(hi, cached) * (1 + 1e-12)


def test_compiled_behaviour(trained: Trained) -> None:
    g = trained["Llama-3-8B/H100/TP1"][1].compiled
    assert isinstance(g, PrefillTimeModel)
    assert g.predict(0, 0) > 0.005  # a full cache hit still costs a forward step (~6.9 ms GPU)
    assert g.predict(0, 0) == g.predict(1, 0)
    # Cached prefix reduces time for the same prompt; README sample 2048 -> 46.9 ms.
    assert g.predict(1024, 7168) < g.predict(8192, 0)
    assert g.predict(2048, 0) == pytest.approx(0.0469, rel=0.05)
    # Linear growth beyond the last knot.
    assert g.predict(131072, 0) > g.predict(65536, 0) > g.predict(32768, 0)


def test_save_load_round_trip(trained: Trained, tmp_path: Path) -> None:
    samples, model, _ = trained["Llama-2-70B/A100/TP8"]
    path = tmp_path / "model.json"
    save_prefill_model(model, path)
    loaded = load_learned_prefill(path)
    assert loaded.meta == model.meta
    assert loaded.compiled == model.compiled
    n, c = samples.new_tokens, samples.cached_tokens
    assert np.array_equal(loaded.predict_many(n, c), model.predict_many(n, c))
    for a, b in zip(n.tolist(), c.tolist(), strict=True):
        assert loaded.compiled.predict(a, b) == model.compiled.predict(a, b)
    doc = json.loads(path.read_text())
    assert doc["features"] == list(FEATURES) == ["n_new", "n_cached", "attn"]
    assert doc["monotone_constraints"] == list(MONOTONE)
    assert doc["booster"].startswith("tree")
    meta = doc["meta"]
    assert meta["rows"] == 142 and meta["config"] == "Llama-2-70B/A100/TP8"
    assert meta["profile"] == "llama2-70b-a100-tp8"
    assert meta["holdout_mape_pct"] <= 5.0 and meta["created_by"].startswith("kvgate")
    saved = load_compiled(path)  # runtime path: no booster
    assert isinstance(saved.grid, GridPrefill) and saved.grid == model.compiled
    assert saved.meta["includes_overhead"] is False


def test_synthetic_training_without_calibration_files(
    synthetic_model: tuple[LearnedPrefill, TrainReport],
) -> None:
    model, report = synthetic_model
    assert report.mape_learned_pct is not None and report.mape_learned_pct < 2.0
    assert report.compiled_vs_booster_max_pct is not None
    assert report.compiled_vs_booster_max_pct <= 1.0
    assert model.compiled.is_monotone_in_new_tokens()
    assert model.predict(1000, 0) == pytest.approx(model.compiled.predict(1000, 0), rel=0.01)


def test_holdout_zero_and_validation() -> None:
    model, report = train_prefill_model(synthetic_samples(), holdout=0.0)
    assert report.mape_learned_pct is None and report.meta.holdout_rows == 0
    assert model.meta.train_rows == len(synthetic_samples())
    with pytest.raises(ValueError, match="holdout"):
        train_prefill_model(synthetic_samples(), holdout=1.0)
    tiny = synthetic_samples().subset(np.arange(5))
    with pytest.raises(ValueError, match="training rows"):
        train_prefill_model(tiny)


def test_holdout_split_is_deterministic_and_disjoint() -> None:
    tr, te = holdout_split(142, 0.2, 3)
    tr2, te2 = holdout_split(142, 0.2, 3)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    assert len(te) == 28 and not set(tr) & set(te) and len(tr) + len(te) == 142
