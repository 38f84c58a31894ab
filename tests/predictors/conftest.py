"""Fixtures for predictors tests.

The calibration grids live outside the repo (read-only ``../shared``); tests that need them skip
with a reason when absent. ``KVGATE_CALIBRATION_RESULTS`` points elsewhere if needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.predictor_files import load_prefill_samples
from predictors.prefill_learned import LearnedPrefill, TrainReport, train_prefill_model
from predictors.samples import PrefillSamples
from tests.predictors.testdata import (
    DECODE_GRID,
    FIT_RESULTS,
    PREFILL_GRID,
    TARGET_CONFIGS,
    synthetic_samples,
)


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"calibration file {path} not available (set KVGATE_CALIBRATION_RESULTS)")
    return path


@pytest.fixture(scope="session")
def prefill_grid() -> Path:
    return _require(PREFILL_GRID)


@pytest.fixture(scope="session")
def decode_grid() -> Path:
    return _require(DECODE_GRID)


@pytest.fixture(scope="session")
def fit_results() -> Path:
    return _require(FIT_RESULTS)


@pytest.fixture(scope="session")
def trained() -> dict[str, tuple[PrefillSamples, LearnedPrefill, TrainReport]]:
    """One learned model per target config (seed 0, 20 % held out), trained once per session."""
    grid = _require(PREFILL_GRID)
    out = {}
    for cfg in TARGET_CONFIGS:
        samples = load_prefill_samples(grid, cfg)
        model, report = train_prefill_model(samples, seed=0, holdout=0.2)
        out[cfg] = (samples, model, report)
    return out


@pytest.fixture(scope="session")
def synthetic_model() -> tuple[LearnedPrefill, TrainReport]:
    return train_prefill_model(synthetic_samples(), seed=0, holdout=0.2)
