"""Everything the scheduler needs to predict one instance's timings, built from settings."""

from __future__ import annotations

from dataclasses import dataclass

from config.settings import PredictorSettings
from predictors.decode import DecodeStepModel
from predictors.grid import SavedPrefill
from predictors.prefill import AnalyticPrefill, PrefillTimeModel
from predictors.profiles import EngineProfile, get_profile
from predictors.transfer import TransferModel, host_link_gbps


@dataclass(frozen=True)
class InstancePredictors:
    profile: EngineProfile
    prefill: PrefillTimeModel
    decode: DecodeStepModel
    link: TransferModel  # KV transfer prefill -> decode and prefix pulls between instances
    host_load: TransferModel  # host-memory tier (HiCache L2) -> GPU
    store_load: TransferModel  # shared store (HiCache L3 / Mooncake store) -> GPU


def saved_prefill_model(
    saved: SavedPrefill, profile: EngineProfile, overhead_ms: float
) -> PrefillTimeModel:
    """The compiled table of a model saved by ``kvgate predictors train`` (no LightGBM needed).

    Models trained on GPU-only calibration grids get the per-step overhead added here; models
    trained on observed engine timings already include it. A model trained for another profile
    is refused rather than silently applied to the wrong hardware."""
    trained_for = saved.meta.get("profile")
    if trained_for is not None and trained_for != profile.name:
        raise ValueError(
            f"{saved.source}: prefill model was trained for profile {trained_for!r}, "
            f"not {profile.name!r}"
        )
    if not saved.meta.get("includes_overhead", True):
        return saved.grid.with_overhead(overhead_ms / 1000.0)
    return saved.grid


def build_instance_predictors(
    settings: PredictorSettings,
    profile_name: str | None = None,
    *,
    measured: EngineProfile | None = None,
    prefill_model: SavedPrefill | None = None,
) -> InstancePredictors:
    """``profile_name`` None = ``settings.profile`` (an instance's own profile overrides it).

    ``measured``: a profile calibrated on the user's engine (``predictors.profile_file``, loaded
    at the edge); it replaces the default profile and answers to its own name. Its times include
    the engine overhead, so ``settings.overhead_ms`` is not added to them.
    ``prefill_model``: ``settings.prefill_model_file``, read at the edge
    (``backends.predictor_files``); required when that setting is set."""
    if measured is not None and profile_name in (None, measured.name):
        profile = measured
    else:
        profile = get_profile(profile_name or settings.profile)
    overhead_ms = profile.overhead_ms if profile.includes_overhead else settings.overhead_ms
    prefill: PrefillTimeModel
    if prefill_model is not None:
        prefill = saved_prefill_model(prefill_model, profile, overhead_ms)
    elif settings.prefill_model_file:
        # The core reads no files: the edge loads it and passes it in (predictor_factory).
        raise ValueError(
            f"predictors.prefill_model_file ({settings.prefill_model_file}) is read at the edge:"
            " build the Conductor with backends.predictor_files.predictor_factory"
        )
    else:
        prefill = AnalyticPrefill.from_profile(profile, overhead_ms)
    kv = profile.kv_bytes_per_token
    return InstancePredictors(
        profile=profile,
        prefill=prefill,
        decode=DecodeStepModel.from_profile(profile, overhead_ms),
        link=TransferModel.from_gbps(kv, settings.link_bandwidth_gbps),
        host_load=TransferModel.from_gbps(
            kv, settings.host_load_gbps or host_link_gbps(profile.gpu)
        ),
        store_load=TransferModel.from_gbps(kv, settings.store_load_gbps),
    )
