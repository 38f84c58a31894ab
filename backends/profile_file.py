"""Read and write the profile files of `kvgate profile` (JSON); validation lives in the core.

The file is read once at startup (``predictors.profile_file``) and handed to the predictors as
data. Every problem is a ``ProfileFileError`` naming the file and, where there is one, the key.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from config.errors import KvgateError
from config.settings import PredictorSettings
from predictors.calibration import (
    CalibratedProfile,
    ProfileDataError,
    profile_from_dict,
    profile_to_dict,
)
from predictors.samples import PrefillSamples


class ProfileFileError(KvgateError, ValueError):
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


@dataclass(frozen=True)
class MeasuredProfiles:
    """``predictors.profile_file`` (the default profile) and ``predictors.profile_files``
    (chosen by name), loaded."""

    default: CalibratedProfile | None = None
    by_name: Mapping[str, CalibratedProfile] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.default is not None or bool(self.by_name)

    def prior(self) -> dict[str | None, PrefillSamples]:
        """The sweeps refits start from, keyed like the learner's observations: None for
        instances on the default profile, else the profile name they give."""
        out: dict[str | None, PrefillSamples] = {
            name: cal.prefill_samples for name, cal in self.by_name.items()
        }
        if self.default is not None:
            out[None] = self.default.prefill_samples
        return out


def load_measured_profiles(settings: PredictorSettings) -> MeasuredProfiles:
    """Every measured profile the settings name; two files with one profile name are refused."""
    default = load_profile_file(settings.profile_file) if settings.profile_file else None
    by_name: dict[str, CalibratedProfile] = {}
    seen: dict[str, str] = {}
    files = ([settings.profile_file] if default is not None else []) + list(settings.profile_files)
    for path in files:
        cal = default if default is not None and path == settings.profile_file else None
        cal = cal or load_profile_file(path)
        name = cal.profile.name
        if name in seen and seen[name] != path:
            raise ProfileFileError(
                f"{path}: key 'name': profile {name!r} is also the name in {seen[name]}"
            )
        seen[name] = path
        by_name[name] = cal
    return MeasuredProfiles(default, by_name)
