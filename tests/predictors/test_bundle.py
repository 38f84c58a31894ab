from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from backends.predictor_files import load_compiled, predictor_factory, save_prefill_model
from config.settings import PredictorSettings
from predictors.bundle import InstancePredictors, build_instance_predictors
from predictors.grid import GridPrefill
from predictors.prefill import AnalyticPrefill
from predictors.prefill_learned import LearnedPrefill, TrainReport, train_prefill_model
from predictors.profiles import get_profile
from tests.predictors.testdata import synthetic_samples


def test_defaults_build_analytic_predictors() -> None:
    preds = build_instance_predictors(PredictorSettings())
    prof = get_profile("llama3-8b-h100-tp1")
    assert preds.profile is prof
    assert isinstance(preds.prefill, AnalyticPrefill)
    # Analytic prefill includes the 0.5 ms per-step overhead; seconds.
    gpu = prof.prefill.gpu_ms(2048, 0)
    assert preds.prefill.predict(2048, 0) == pytest.approx((gpu + 0.5) / 1000)
    assert preds.decode.step_time(32, 32 * 1024) == pytest.approx(
        (prof.decode.gpu_ms(32, 32 * 1024) + 0.5) / 1000
    )
    # Links: gigabits/s -> bytes/s, KV bytes from the profile.
    assert preds.link.bytes_per_token == 131072
    assert preds.link.bandwidth_bytes_per_s == pytest.approx(200e9 / 8)
    # Host tier: the profile GPU's link (an H100's PCIe Gen5) unless set.
    assert preds.host_load.bandwidth_bytes_per_s == pytest.approx(400e9 / 8)
    assert preds.store_load.bandwidth_bytes_per_s == pytest.approx(100e9 / 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        preds.link = preds.host_load  # type: ignore[misc]


def test_profile_override_and_settings() -> None:
    s = PredictorSettings(overhead_ms=2.0, link_bandwidth_gbps=400.0, store_load_gbps=25.0)
    preds = build_instance_predictors(s, "llama2-70b-a100-tp8")
    assert preds.profile.name == "llama2-70b-a100-tp8"
    assert preds.link.bytes_per_token == 327680
    assert preds.link.bandwidth_bytes_per_s == pytest.approx(50e9)
    assert preds.store_load.bandwidth_bytes_per_s == pytest.approx(25e9 / 8)
    assert preds.host_load.bandwidth_bytes_per_s == pytest.approx(200e9 / 8)  # A100: Gen4
    assert preds.decode.overhead_ms == 2.0
    pinned = build_instance_predictors(PredictorSettings(host_load_gbps=80.0), "llama3-8b-h100-tp1")
    assert pinned.host_load.bandwidth_bytes_per_s == pytest.approx(80e9 / 8)  # the user's wins
    assert isinstance(preds, InstancePredictors)
    with pytest.raises(KeyError, match="known profiles"):
        build_instance_predictors(PredictorSettings(profile="nope"))


@pytest.fixture(scope="module")
def gpu_model_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LearnedPrefill]:
    model, _ = train_prefill_model(synthetic_samples("Llama-3-8B/H100/TP1"))
    path = tmp_path_factory.mktemp("m") / "prefill.json"
    save_prefill_model(model, path)
    return path, model


def test_learned_model_file_is_loaded_compiled_with_overhead(
    gpu_model_file: tuple[Path, LearnedPrefill],
) -> None:
    path, model = gpu_model_file
    s = PredictorSettings(prefill_model_file=str(path), overhead_ms=1.0)
    factory = predictor_factory(s)
    assert factory is not None
    preds = factory(None)
    assert isinstance(preds.prefill, GridPrefill)
    # GPU-only training data: the per-step overhead is added at load time.
    assert preds.prefill.predict(3000, 500) == pytest.approx(
        model.compiled.predict(3000, 500) + 0.001
    )


def test_learned_model_for_other_profile_is_refused(
    gpu_model_file: tuple[Path, LearnedPrefill],
) -> None:
    saved = load_compiled(gpu_model_file[0])
    s = PredictorSettings(prefill_model_file=str(gpu_model_file[0]))
    with pytest.raises(ValueError, match="trained for profile 'llama3-8b-h100-tp1'"):
        build_instance_predictors(s, "llama2-70b-a100-tp8", prefill_model=saved)


def test_observed_model_keeps_its_overhead_and_fits_any_profile(tmp_path: Path) -> None:
    model, report = train_prefill_model(synthetic_samples(config=None))
    assert isinstance(report, TrainReport) and model.meta.includes_overhead
    path = tmp_path / "observed.json"
    save_prefill_model(model, path)
    factory = predictor_factory(PredictorSettings(prefill_model_file=str(path)))
    assert factory is not None
    preds = factory("llama3-70b-h100-tp8")
    assert preds.prefill.predict(3000, 500) == model.compiled.predict(3000, 500)


def test_missing_model_file_raises_at_the_edge(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        predictor_factory(PredictorSettings(prefill_model_file=str(tmp_path / "x.json")))


def test_core_reads_no_model_file() -> None:
    """The file is the edge's to read: the core refuses a setting it was not handed data for."""
    s = PredictorSettings(prefill_model_file="/nonexistent/model.json")
    with pytest.raises(ValueError, match="read at the edge"):
        build_instance_predictors(s)


def test_nothing_to_load_leaves_the_conductor_its_default() -> None:
    assert predictor_factory(PredictorSettings()) is None
