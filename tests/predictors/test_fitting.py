from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from predictors.fitting import (
    MonotoneBase,
    fit_monotone_base,
    fit_p5,
    isotonic,
    relative_nnls,
)


def test_relative_nnls_recovers_exact_coefficients() -> None:
    rng = np.random.default_rng(0)
    x = np.stack([np.ones(50), rng.uniform(1, 100, 50), rng.uniform(0, 1e4, 50)], axis=1)
    coef = np.array([2.0, 0.5, 1e-3])
    assert relative_nnls(x, x @ coef) == pytest.approx(coef, rel=1e-9)


def test_relative_nnls_never_returns_negative_terms() -> None:
    x = np.stack([np.ones(20), np.arange(20.0)], axis=1)
    y = 50.0 - 2.0 * np.arange(20.0)  # decreasing: the slope would be negative
    coef = relative_nnls(x, y)
    assert np.all(coef >= 0)
    assert coef[1] == 0.0


@given(st.lists(st.floats(-100, 100), min_size=1, max_size=30))
def test_isotonic_is_monotone_and_preserves_weighted_mean(values: list[float]) -> None:
    v = np.array(values)
    w = np.ones_like(v)
    out = isotonic(v, w)
    assert out.shape == v.shape
    assert np.all(np.diff(out) >= -1e-9)
    assert out.mean() == pytest.approx(v.mean(), abs=1e-6)


def test_isotonic_pools_violators() -> None:
    assert isotonic(np.array([1.0, 3.0, 2.0, 4.0]), np.ones(4)).tolist() == [1.0, 2.5, 2.5, 4.0]


def _p5_data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = np.repeat([16.0, 64, 128, 256, 512, 1024, 4096, 16384], 4)
    c = np.tile([0.0, 1024, 8192, 24576], 8)
    y = 2.0 + 0.02 * np.maximum(n, 256) + 7e-7 * n * (c + n / 2)
    return n, c, y


def test_fit_p5_recovers_knee_and_coefficients() -> None:
    n, c, y = _p5_data()
    fit = fit_p5(n, c, y)
    assert fit.n0 == 256
    assert (fit.a, fit.b, fit.c) == (
        pytest.approx(2.0, rel=1e-6),
        pytest.approx(0.02, rel=1e-6),
        pytest.approx(7e-7, rel=1e-6),
    )
    assert fit.mape_pct < 1e-6
    assert fit.evaluate(n, c) == pytest.approx(y)


def test_monotone_base_fits_wiggle_and_stays_monotone() -> None:
    n, c, y = _p5_data()
    y = y * (1 + 0.05 * np.sin(np.log2(n)))  # non-P5 wiggle, still increasing in n
    base = fit_monotone_base(n, c, y)
    err = np.abs(base.evaluate(n, c) / y - 1)
    assert err.mean() < 0.01
    grid_n = np.arange(0, 70_000, 37, dtype=np.float64)
    for cached in (0.0, 5000.0, 100_000.0):
        vals = base.evaluate(grid_n, np.full_like(grid_n, cached))
        assert np.all(np.diff(vals) >= 0)
        assert np.all(vals > 0)


def test_monotone_base_many_distinct_lengths_uses_quantile_knots() -> None:
    rng = np.random.default_rng(1)
    n = rng.integers(1, 20_000, 2000).astype(np.float64)
    c = rng.integers(0, 20_000, 2000).astype(np.float64)
    y = (3.0 + 0.02 * n + 7e-7 * n * (c + n / 2)) * rng.lognormal(0, 0.02, 2000)
    base = fit_monotone_base(n, c, y, max_knots=24)
    assert len(base.n_knots) <= 24
    assert np.mean(np.abs(base.evaluate(n, c) / y - 1)) < 0.05
    assert MonotoneBase.from_dict(base.to_dict()) == base
