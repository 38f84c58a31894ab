"""Read and write the profile files of `kvgate profile` (JSON); validation lives in the core.

The file is read once at startup (``predictors.profile_file``) and handed to the predictors as
data. Every problem is a ``ProfileFileError`` naming the file and, where there is one, the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from config.settings import PredictorSettings
from predictors.bundle import InstancePredictors, build_instance_predictors
from predictors.calibration import (
    CalibratedProfile,
    ProfileDataError,
    profile_from_dict,
    profile_to_dict,
)


class ProfileFileError(ValueError):
    """A profile file cannot be used; the message starts with the file (and names the key)."""


def load_profile_file(path: str | Path) -> CalibratedProfile:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileFileError(f"{p}: cannot read profile file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ProfileFileError(f"{p}: profile file is not UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileFileError(f"{p}: profile file is not valid JSON: {exc}") from None
    try:
        return profile_from_dict(data, str(p))
    except ProfileDataError as exc:
        raise ProfileFileError(f"{p}: {exc}") from None


def write_profile_file(path: str | Path, profile: CalibratedProfile) -> None:
    """Atomically (write + rename): a gateway reading it never sees half a file."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(profile_to_dict(profile), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, p)


def load_measured_profile(settings: PredictorSettings) -> CalibratedProfile | None:
    """``predictors.profile_file`` loaded, or None when unset."""
    return load_profile_file(settings.profile_file) if settings.profile_file else None


def measured_predictors(
    settings: PredictorSettings, measured: CalibratedProfile | None
) -> Callable[[str | None], InstancePredictors] | None:
    """The Conductor's predictor factory for a measured profile (None: the Conductor's own).
    One ``InstancePredictors`` per profile name, shared by the instances that use it."""
    if measured is None:
        return None
    cache: dict[str | None, InstancePredictors] = {}

    def predictors_for(profile_name: str | None) -> InstancePredictors:
        if profile_name not in cache:
            cache[profile_name] = build_instance_predictors(
                settings, profile_name, measured=measured.profile
            )
        return cache[profile_name]

    return predictors_for
