"""Fitting a measured profile, its file format and its validation."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from config.settings import PredictorSettings
from predictors.bundle import build_instance_predictors
from predictors.calibration import (
    ProfileDataError,
    SweepSample,
    fit_profile,
    profile_from_dict,
    profile_to_dict,
)
from predictors.profiles import DecodeCoeffs, PrefillCoeffs, get_profile

TRUE_PREFILL = PrefillCoeffs(a_ms=12.0, b_ms=0.4, n0=64, c_ms=2e-5)
TRUE_DECODE = DecodeCoeffs(a_ms=9.0, b_ms=1.5, k_ms=0.002)


def synthetic_sweep(noise: float = 0.0, seed: int = 1) -> list[SweepSample]:
    rng = np.random.default_rng(seed)
    out = []
    for n in (64, 128, 256, 512, 1024, 2048, 3072):
        for frac in (0.0, 0.5, 0.9):
            cached = int(n * frac)
            new = n - cached
            ms = TRUE_PREFILL.gpu_ms(new, cached) * (1 + noise * rng.standard_normal())
            out.append(SweepSample(new_tokens=new, cached_tokens=cached, seconds=ms / 1000))
    for b in (1, 2, 4, 8):
        for ctx in (128, 1024, 3000):
            k = b * ctx
            ms = TRUE_DECODE.gpu_ms(b, k) * (1 + noise * rng.standard_normal())
            out.append(SweepSample(batch=b, context_tokens=k, seconds=ms / 1000))
    return out


def test_fit_recovers_known_coefficients_exactly_without_noise() -> None:
    cal = fit_profile(synthetic_sweep(), name="mine", model="tiny", target="http://x")
    p = cal.profile
    assert p.prefill.n0 == 64
    assert p.prefill.a_ms == pytest.approx(12.0, rel=1e-3)
    assert p.prefill.b_ms == pytest.approx(0.4, rel=1e-3)
    assert p.prefill.c_ms == pytest.approx(2e-5, rel=1e-3)
    assert p.decode.a_ms == pytest.approx(9.0, rel=1e-3)
    assert p.decode.b_ms == pytest.approx(1.5, rel=1e-3)
    assert p.decode.k_ms == pytest.approx(0.002, rel=1e-3)
    assert cal.quality.prefill_mape_pct < 0.1 and cal.quality.decode_mape_pct < 0.1
    assert p.includes_overhead and p.overhead_ms == 0.0 and p.name == "mine"


def test_fit_with_noise_predicts_within_a_few_percent() -> None:
    cal = fit_profile(synthetic_sweep(noise=0.03), name="noisy", model="tiny")
    for n, c in ((100, 0), (1000, 0), (2000, 1000), (3000, 0)):
        truth = TRUE_PREFILL.gpu_ms(n, c)
        assert cal.profile.prefill.gpu_ms(n, c) == pytest.approx(truth, rel=0.06)


def test_fit_keeps_base_decode_without_decode_samples() -> None:
    prefill_only = [s for s in synthetic_sweep() if s.batch == 0]
    cal = fit_profile(prefill_only, name="p", model="m")
    assert cal.profile.decode == get_profile("llama3-8b-h100-tp1").decode
    assert cal.quality.decode_mape_pct is None and cal.decode_samples is None


def test_fit_keeps_base_decode_with_repeats_of_too_few_cases() -> None:
    repeats = [SweepSample(batch=b, context_tokens=100 * b, seconds=0.01) for b in (1, 2) * 3]
    prefill = [s for s in synthetic_sweep() if s.batch == 0]
    cal = fit_profile(prefill + repeats, name="p", model="m")
    assert cal.profile.decode == get_profile("llama3-8b-h100-tp1").decode
    assert cal.quality.decode_mape_pct is None and cal.quality.decode_samples == 6


def test_fit_needs_prefill_samples() -> None:
    with pytest.raises(ValueError, match="at least 4 prefill samples"):
        fit_profile([SweepSample(new_tokens=10, seconds=0.01)], name="p", model="m")


def test_dict_round_trip_keeps_coefficients_and_samples() -> None:
    cal = fit_profile(synthetic_sweep(), name="mine", model="tiny", kv_capacity_tokens=8192)
    back = profile_from_dict(profile_to_dict(cal), "f.json")
    assert back.profile.prefill == cal.profile.prefill
    assert back.profile.decode == cal.profile.decode
    assert back.profile.kv_capacity_tokens == 8192
    assert back.profile.includes_overhead
    assert np.array_equal(back.prefill_samples.new_tokens, cal.prefill_samples.new_tokens)
    assert np.allclose(back.prefill_samples.seconds, cal.prefill_samples.seconds)
    assert back.decode_samples is not None and len(back.decode_samples) == 12


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.__setitem__("format", "other"), "format"),
        (lambda d: d["prefill"].pop("b_ms"), "prefill.b_ms"),
        (lambda d: d["prefill"].__setitem__("a_ms", -1), "prefill.a_ms"),
        (lambda d: d["decode"].__setitem__("k_ms", "fast"), "decode.k_ms"),
        (lambda d: d["prefill"].__setitem__("n0", 1.5), "prefill.n0"),
        (lambda d: d.__setitem__("kv_capacity_tokens", 0), "kv_capacity_tokens"),
        (lambda d: d["samples"]["prefill"].append([1, 2]), "samples.prefill[21]"),
        (lambda d: d.__setitem__("decode", None), "decode"),
    ],
)
def test_bad_profile_data_names_the_key(edit, key: str) -> None:
    data = copy.deepcopy(profile_to_dict(fit_profile(synthetic_sweep(), name="a", model="m")))
    edit(data)
    with pytest.raises(ProfileDataError) as info:
        profile_from_dict(data, "f.json")
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_measured_profile_replaces_the_default_without_extra_overhead() -> None:
    cal = fit_profile(synthetic_sweep(), name="mine", model="tiny")
    settings = PredictorSettings(overhead_ms=0.5)
    for name in (None, "mine"):
        preds = build_instance_predictors(settings, name, measured=cal.profile)
        assert preds.profile is cal.profile
        # The measured time holds the engine overhead: predictors.overhead_ms is not added.
        assert preds.prefill.predict(1024, 0) == pytest.approx(
            cal.profile.prefill.gpu_ms(1024, 0) / 1000
        )
        assert preds.decode.step_time(2, 2000) == pytest.approx(
            cal.profile.decode.gpu_ms(2, 2000) / 1000
        )
    other = build_instance_predictors(settings, "llama3-8b-h100-tp1", measured=cal.profile)
    assert other.profile.name == "llama3-8b-h100-tp1"
    assert other.prefill.predict(1024, 0) == pytest.approx(
        (other.profile.prefill.gpu_ms(1024, 0) + 0.5) / 1000
    )
