from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.predictor_files import grid_configs, load_prefill_samples
from predictors.prefill import AnalyticPrefill, PrefillTimeModel
from predictors.profiles import PROFILES, get_profile, profile_name_for_config

L3_8B_H100 = get_profile("llama3-8b-h100-tp1")
GPU_ONLY = AnalyticPrefill.from_profile(L3_8B_H100, overhead_ms=0.0)


def test_readme_sample_point_2048_tokens() -> None:
    # README §4 sample: Llama-3-8B/H100 prefill 2048 -> 46.9 ms GPU. Returned in seconds.
    assert GPU_ONLY.predict(2048, 0) == pytest.approx(0.0469, rel=0.05)


@pytest.mark.parametrize(
    ("new", "cached", "ms"),
    [(512, 0, 12.6), (8192, 0, 214.0), (16384, 0, 461.0),
     (1024, 0, 22.8), (1024, 8192, 28.7), (1024, 24576, 40.4)],
)  # fmt: skip
def test_readme_sample_points_within_p5_form_error(new: int, cached: int, ms: float) -> None:
    # P5 has 3.7 % MAPE and up to ~18 % max error vs the composed model (README §3): 8 % here.
    assert GPU_ONLY.predict(new, cached) * 1000 == pytest.approx(ms, rel=0.08)


def test_llama3_70b_h100_tp4_sample_point() -> None:
    model = AnalyticPrefill.from_profile(get_profile("llama3-70b-h100-tp4"), overhead_ms=0.0)
    assert model.predict(2048, 0) == pytest.approx(0.132, rel=0.05)


def test_overhead_is_added_in_seconds() -> None:
    default = AnalyticPrefill.from_profile(L3_8B_H100)  # profile default 0.5 ms
    assert default.predict(2048, 0) - GPU_ONLY.predict(2048, 0) == pytest.approx(0.0005)
    two = AnalyticPrefill.from_profile(L3_8B_H100, overhead_ms=2.0)
    assert two.predict(100, 100) - GPU_ONLY.predict(100, 100) == pytest.approx(0.002)


def test_zero_new_tokens_costs_one_forward_step() -> None:
    p = L3_8B_H100.prefill
    expected = (p.a_ms + p.b_ms * p.n0 + 0.5) / 1000.0
    model = AnalyticPrefill.from_profile(L3_8B_H100)
    assert model.predict(0, 0) == pytest.approx(expected)
    assert model.predict(0, 50_000) == pytest.approx(expected)
    assert model.predict(0, 0) > 0


def test_knee_makes_short_prompts_flat() -> None:
    # Only the (tiny) attention term varies below n0.
    assert GPU_ONLY.predict(1, 0) == pytest.approx(GPU_ONLY.predict(200, 0), rel=5e-3)


def test_is_a_prefill_time_model() -> None:
    assert isinstance(GPU_ONLY, PrefillTimeModel)


@given(
    n1=st.integers(0, 200_000),
    n2=st.integers(0, 200_000),
    cached=st.integers(0, 200_000),
    name=st.sampled_from(sorted(PROFILES)),
)
def test_monotone_in_new_tokens(n1: int, n2: int, cached: int, name: str) -> None:
    model = AnalyticPrefill.from_profile(PROFILES[name])
    lo, hi = sorted((n1, n2))
    assert model.predict(lo, cached) <= model.predict(hi, cached)


@given(
    total=st.integers(1, 100_000), frac=st.floats(0.01, 1.0), name=st.sampled_from(sorted(PROFILES))
)
def test_cached_prefix_reduces_time(total: int, frac: float, name: str) -> None:
    model = AnalyticPrefill.from_profile(PROFILES[name])
    cached = int(total * frac)
    # Same prompt: reusing a cached prefix is never slower than recomputing it.
    assert model.predict(total - cached, cached) <= model.predict(total, 0)
    if cached >= 512:  # strictly faster once the saved work exceeds the knee
        assert model.predict(total - cached, cached) < model.predict(total, 0)


def test_all_profiles_match_composed_grid_within_readme_mape(prefill_grid: Path) -> None:
    for cfg in grid_configs(prefill_grid):
        name = profile_name_for_config(cfg)
        assert name is not None, cfg
        model = AnalyticPrefill.from_profile(PROFILES[name], overhead_ms=0.0)
        s = load_prefill_samples(prefill_grid, cfg)
        pairs = zip(s.new_tokens.tolist(), s.cached_tokens.tolist(), strict=True)
        pred = np.array([model.predict(n, c) for n, c in pairs])
        mape = float(np.mean(np.abs(pred / s.seconds - 1.0)) * 100)
        assert mape <= 4.7, (cfg, mape)  # README §3: P5 MAPE 2.5-4.6 %
