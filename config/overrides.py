"""Layering on top of the config file: ``KVGATE__SECTION__KEY`` env vars and code overrides.

Precedence, lowest to highest: file < environment < ``overrides`` argument (explicit code,
e.g. CLI flags, wins over the ambient environment). Every key set here is recorded in
``origins`` so a later validation error names the env var or "<overrides>", not the file.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from config.coerce import toml_type_name
from config.errors import ConfigIssue, format_path

ENV_PREFIX = "KVGATE__"
OVERRIDES_SOURCE = "<overrides>"


@dataclass(slots=True)
class Layering:
    """What the override layers did besides changing the data."""

    origins: dict[str, str] = field(default_factory=dict)  # key path -> source label
    raw_strings: dict[str, str] = field(default_factory=dict)  # key path -> env text
    issues: list[ConfigIssue] = field(default_factory=list)


class _PathError(Exception):
    pass


def parse_env_value(raw: str) -> Any:
    """``"5"`` -> 5, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``'"x"'`` -> "x", else the text."""
    if "\n" in raw or "\r" in raw:
        return raw  # never let one variable smuggle extra TOML keys in
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    value = parsed.get("v")
    # Arrays, tables and dates stay text: only scalars are meant to be typed here.
    if len(parsed) == 1 and isinstance(value, bool | int | float | str):
        return value
    return raw


def _match_key(node: Mapping[str, Any], segment: str, fold_case: bool) -> str:
    if segment in node or not fold_case:
        return segment
    for key in node:
        if key.lower() == segment.lower():
            return key
    return segment.lower()


def _set_path(
    root: MutableMapping[str, Any],
    segments: Sequence[str],
    value: Any,
    *,
    delete: bool = False,
    fold_case: bool = False,
) -> tuple[str, str | None]:
    """Set (or delete) ``root[seg0][seg1]...``, creating missing tables.

    Returns the dotted key path set and the path of the outermost table created (if any): the
    override owns that table, so e.g. "slo.ttft_s must be a number, got table" blames it.
    """
    node: Any = root
    resolved: list[str | int] = []
    created: str | None = None
    for i, segment in enumerate(segments):
        if not segment:
            raise _PathError("empty key segment")
        key: str | int
        if isinstance(node, list):
            here = format_path(resolved)
            if not segment.isdigit():
                raise _PathError(f"{here} is an array; the next segment must be an index like 0")
            key = int(segment)
            if key >= len(node):
                raise _PathError(f"{here} has {len(node)} entries; index {key} is out of range")
        elif isinstance(node, MutableMapping):
            key = _match_key(node, segment, fold_case)
        else:
            here = format_path(resolved)
            raise _PathError(f"{here} is not a table (it is {toml_type_name(node)})")
        resolved.append(key)
        if i == len(segments) - 1:
            break
        if isinstance(node, MutableMapping) and key not in node:
            if delete:
                return format_path(resolved + list(segments[i + 1 :])), None
            node[key] = {}
            created = created or format_path(resolved)
        node = node[key]
    if delete:
        if isinstance(node, list):
            raise _PathError("cannot remove an array entry")
        node.pop(key, None)
    else:
        node[key] = value
    return format_path(resolved), created


def _claim(layering: Layering, path: str, source: str, created: str | None) -> None:
    """Record that ``source`` now owns ``path`` and everything below it."""
    below = (path + ".", path + "[")
    for table in (layering.origins, layering.raw_strings):
        for key in [k for k in table if k == path or k.startswith(below)]:
            del table[key]
    layering.origins[path] = source
    if created is not None:
        layering.origins.setdefault(created, source)


def apply_env(data: MutableMapping[str, Any], env: Mapping[str, str], layering: Layering) -> None:
    """Apply ``KVGATE__A__B=value`` variables in name order. An empty value removes the key,
    so the built-in default applies again (e.g. to disable an admin token set in the file)."""
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        raw = env[name]
        source = f"env {name}"
        segments = name[len(ENV_PREFIX) :].split("__")
        wanted = format_path([int(s) if s.isdigit() else s.lower() for s in segments])
        value = parse_env_value(raw)
        try:
            path, created = _set_path(data, segments, value, delete=raw == "", fold_case=True)
        except _PathError as exc:
            layering.issues.append(ConfigIssue(source, wanted, raw, f"cannot set: {exc}"))
            continue
        _claim(layering, path, source, created)
        layering.raw_strings[path] = raw


def _flatten(overrides: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[Any]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for key, value in overrides.items():
        parts = prefix + tuple(str(key).split("."))
        if isinstance(value, Mapping) and value:
            out.extend(_flatten(value, parts))
        else:
            out.append((parts, value))
    return out


def apply_overrides(
    data: MutableMapping[str, Any], overrides: Mapping[str, Any], layering: Layering
) -> None:
    """Deep-merge ``overrides`` (nested tables merge, anything else replaces; a dotted key like
    ``"slo.ttft_s"`` is the same as ``{"slo": {"ttft_s": ...}}``)."""
    for parts, value in _flatten(overrides):
        plain = dict(value) if isinstance(value, Mapping) else copy.deepcopy(value)
        try:
            path, created = _set_path(data, parts, plain)
        except _PathError as exc:
            key = ".".join(parts)
            layering.issues.append(ConfigIssue(OVERRIDES_SOURCE, key, value, f"cannot set: {exc}"))
            continue
        _claim(layering, path, OVERRIDES_SOURCE, created)
