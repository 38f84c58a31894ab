"""Load, validate and serialise ``Settings``.

``load_settings`` reads a TOML file, layers ``KVGATE__SECTION__KEY`` environment variables and
code overrides on top, then validates. ``settings_from_dict`` runs the very same validation on
plain data (the admin API uses it for live changes); ``settings_to_dict`` is its inverse.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from config.checks import check_settings
from config.coerce import INVALID, BuildContext, build_dataclass, to_plain
from config.errors import MISSING, ConfigError, IssueCollector
from config.fleet_checks import assign_pool_models, inherit_pool_role
from config.overrides import Layering, apply_env, apply_overrides
from config.settings import PoolSettings, Settings

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build validated settings from ``path`` (None = built-in defaults), then the environment
    (``KVGATE__SLO__TTFT_S=5``; defaults to ``os.environ``), then ``overrides``.

    Raises ``ConfigError`` listing every problem, each naming its file or env var and key.
    """
    source = "<defaults>" if path is None else str(path)
    data: dict[str, Any] = {} if path is None else _read_toml(Path(path), source)
    layering = Layering()
    apply_env(data, os.environ if env is None else env, layering)
    if overrides:
        apply_overrides(data, overrides, layering)
    return _build(data, source, layering)


def settings_from_dict(data: Mapping[str, Any], source: str = "<dict>") -> Settings:
    """Validate plain data (as parsed from TOML or JSON) exactly like ``load_settings``."""
    return _build(data, source, Layering())


def settings_to_dict(settings: Settings) -> dict[str, Any]:
    """Plain dicts/lists/scalars (enums as their values, unset optional keys left out) that
    ``settings_from_dict`` turns back into an equal ``Settings``. Includes the admin token."""
    result = to_plain(settings)
    assert isinstance(result, dict)
    return result


def validate_settings(settings: Settings, source: str = "<settings>") -> Settings:
    """Re-validate settings built in code (e.g. with ``dataclasses.replace``); returns a
    normalised copy (ints in float fields become floats, raw tables become read-only)."""
    return settings_from_dict(settings_to_dict(settings), source)


def example_path(name: str) -> Path:
    """Path of a bundled example config: ``example_path("pd-vllm")`` or ``"pd-vllm.toml"``."""
    file = EXAMPLES_DIR / (name if name.endswith(".toml") else f"{name}.toml")
    if not file.is_file():
        known = ", ".join(example_names())
        raise FileNotFoundError(f"no example config {name!r}; available: {known}")
    return file


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.toml"))


def _read_toml(path: Path, source: str) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(source, "", MISSING, f"cannot read config file: {reason}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "", MISSING, f"not valid UTF-8: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message carries "(at line L, column C)"; keep it verbatim.
        raise ConfigError(source, "", MISSING, f"invalid TOML: {exc}") from exc


def _build(data: Mapping[str, Any], source: str, layering: Layering) -> Settings:
    issues = IssueCollector(source, layering.origins)
    for issue in layering.issues:
        issues.add_issue(issue)
    ctx = BuildContext(
        issues=issues,
        raw_strings=layering.raw_strings,
        prepare={Settings: assign_pool_models, PoolSettings: inherit_pool_role},
    )
    settings = build_dataclass(Settings, data, "", ctx)
    issues.raise_if_any()  # semantic checks need fully typed settings
    assert settings is not INVALID
    check_settings(settings, issues)
    issues.raise_if_any()
    return settings
