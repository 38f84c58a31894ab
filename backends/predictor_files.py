"""The predictors' files, read and written at the edge: timing samples (CSV) and saved prefill
models (JSON). The pure core (``predictors/``) parses and checks what is read here.

``predictor_factory`` is what the gateway and the simulator hand the Conductor: it reads
``predictors.prefill_model_file`` once, and measured profiles (``backends.profile_file``) are
passed in already loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config.settings import PredictorSettings
from predictors.bundle import InstancePredictors, build_instance_predictors
from predictors.decode import DecodeSamples, parse_decode_samples
from predictors.grid import SavedPrefill, check_model_doc, compiled_from_doc
from predictors.samples import PrefillSamples, list_configs, parse_prefill_samples

if TYPE_CHECKING:  # LightGBM is imported only by the commands that train or evaluate
    from backends.profile_file import MeasuredProfiles
    from predictors.prefill_learned import LearnedPrefill

PredictorFactory = Callable[[str | None], InstancePredictors]


def _read_text(path: str | Path) -> str:
    """A file's text; a missing or unreadable file raises ``OSError`` (callers report it)."""
    return Path(path).read_text(encoding="utf-8")


def load_prefill_samples(path: str | Path, config: str | None = None) -> PrefillSamples:
    return parse_prefill_samples(_read_text(path), str(path), config)


def load_decode_samples(path: str | Path, config: str | None = None) -> DecodeSamples:
    return parse_decode_samples(_read_text(path), str(path), config)


def grid_configs(path: str | Path) -> list[str]:
    """Configs present in a calibration grid file, in first-seen order."""
    return list_configs(_read_text(path), str(path))


def read_model_file(path: str | Path) -> dict[str, Any]:
    """Parse and sanity-check a model file written by ``save_prefill_model``."""
    try:
        doc = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a kvgate prefill model file ({exc})") from None
    return check_model_doc(doc, str(path))


def load_compiled(path: str | Path) -> SavedPrefill:
    """The compiled table and training metadata of a saved model, without LightGBM."""
    return compiled_from_doc(read_model_file(path), str(path))


def load_learned_prefill(path: str | Path) -> LearnedPrefill:
    """The whole model, booster included (offline: eval, tests). Imports LightGBM."""
    from predictors.prefill_learned import LearnedPrefill

    return LearnedPrefill.from_doc(read_model_file(path), str(path))


def save_prefill_model(model: LearnedPrefill, path: str | Path) -> None:
    """Atomically (write + rename): a gateway reading it never sees half a file."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(model.to_doc()), encoding="utf-8")
    os.replace(tmp, p)


def predictor_factory(
    settings: PredictorSettings, measured: MeasuredProfiles | None = None
) -> PredictorFactory | None:
    """The Conductor's predictor factory for what the settings load from files (None: nothing
    to load, the Conductor's own default serves). One ``InstancePredictors`` per profile name,
    shared by the instances that use it. Reads ``prefill_model_file`` now: startup/reload."""
    saved = load_compiled(settings.prefill_model_file) if settings.prefill_model_file else None
    if saved is None and not measured:
        return None
    cache: dict[str | None, InstancePredictors] = {}

    def predictors_for(profile_name: str | None) -> InstancePredictors:
        if profile_name not in cache:
            chosen = None
            if measured:
                chosen = measured.by_name.get(profile_name) if profile_name else measured.default
            cache[profile_name] = build_instance_predictors(
                settings,
                profile_name,
                measured=chosen.profile if chosen else None,
                prefill_model=saved,
            )
        return cache[profile_name]

    return predictors_for
