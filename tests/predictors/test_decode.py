from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.predictor_files import load_decode_samples
from predictors.decode import DecodeSamples, DecodeStepModel
from predictors.profiles import PROFILES, get_profile

L3_8B = DecodeStepModel.from_profile(get_profile("llama3-8b-h100-tp1"), overhead_ms=0.0)


@pytest.mark.parametrize(("batch", "ms"), [(1, 6.9), (32, 8.7), (128, 13.2), (256, 20.1)])
def test_readme_sample_points_llama3_8b_h100(batch: int, ms: float) -> None:
    # README §4: decode at ctx 1024 per sequence; K is the batch total.
    assert L3_8B.step_time(batch, batch * 1024) == pytest.approx(ms / 1000, rel=0.05)


@pytest.mark.parametrize(("batch", "ms"), [(1, 16.3), (64, 20.1)])
def test_readme_sample_points_llama3_70b_h100_tp4(batch: int, ms: float) -> None:
    model = DecodeStepModel.from_profile(get_profile("llama3-70b-h100-tp4"), overhead_ms=0.0)
    assert model.step_time(batch, batch * 1024) == pytest.approx(ms / 1000, rel=0.05)


def test_overhead_and_empty_batch() -> None:
    prof = get_profile("llama3-8b-h100-tp1")
    default = DecodeStepModel.from_profile(prof)  # 0.5 ms profile default
    assert default.overhead_ms == 0.5
    assert default.step_time(8, 8000) - L3_8B.step_time(8, 8000) == pytest.approx(0.0005)
    assert default.step_time(0, 0) == 0.0
    assert default.step_time(0, 5000) == 0.0


def test_monotone_in_batch_and_context() -> None:
    for prof in PROFILES.values():
        m = DecodeStepModel.from_profile(prof)
        assert m.step_time(2, 1000) > m.step_time(1, 1000)
        assert m.step_time(2, 2000) > m.step_time(2, 1000)


def test_fit_recovers_synthetic_coefficients() -> None:
    rng = np.random.default_rng(0)
    batch = rng.integers(1, 256, 60)
    ctx = batch * rng.integers(100, 8000, 60)
    secs = (5.0 + 0.02 * batch + 5e-5 * ctx) / 1000
    fitted = DecodeStepModel.fit(DecodeSamples(batch, ctx, secs, "synthetic"))
    assert (fitted.a_ms, fitted.b_ms, fitted.k_ms) == (
        pytest.approx(5.0, rel=1e-6),
        pytest.approx(0.02, rel=1e-6),
        pytest.approx(5e-5, rel=1e-6),
    )
    assert fitted.overhead_ms == 0.0
    assert fitted.step_time(10, 10_000) == pytest.approx((5.0 + 0.2 + 0.5) / 1000)
    with pytest.raises(ValueError):
        DecodeStepModel.fit(DecodeSamples(batch[:2], ctx[:2], secs[:2], "tiny"))


def test_fit_on_decode_grid_reproduces_profile(decode_grid: Path) -> None:
    samples = load_decode_samples(decode_grid, "Llama-3-8B/H100/TP1")
    assert samples.includes_overhead is False
    fitted = DecodeStepModel.fit(samples, overhead_ms=0.5)
    d = get_profile("llama3-8b-h100-tp1").decode
    assert fitted.a_ms == pytest.approx(d.a_ms, rel=0.01)
    assert fitted.b_ms == pytest.approx(d.b_ms, rel=0.01)
    assert fitted.k_ms == pytest.approx(d.k_ms, rel=0.01)
    gpu = DecodeStepModel(fitted.a_ms, fitted.b_ms, fitted.k_ms)
    pairs = zip(samples.batch.tolist(), samples.context_tokens.tolist(), strict=True)
    pred = np.array([gpu.step_time(b, k) for b, k in pairs])
    assert float(np.mean(np.abs(pred / samples.seconds - 1)) * 100) < 2.5  # README D2: 2.3 %


def test_load_decode_formats_and_errors(tmp_path: Path) -> None:
    grid = tmp_path / "g.csv"
    grid.write_text("config,batch,ctx_per_seq,ctx_total,gpu_ms\nX,2,100,200,7.5\n")
    s = load_decode_samples(grid)
    assert (s.batch.tolist(), s.context_tokens.tolist(), s.seconds.tolist()) == (
        [2], [200], [0.0075]
    )  # fmt: skip
    obs = tmp_path / "o.csv"
    obs.write_text("batch,context_tokens,step_s\n4,4096,0.01\n4,oops,0.01\n")
    with pytest.raises(ValueError, match=r"o\.csv:3: context_tokens='oops'"):
        load_decode_samples(obs)
    with pytest.raises(ValueError, match="unknown config"):
        load_decode_samples(grid, "Y")
