"""Build frozen dataclasses from plain TOML/JSON data, driven by the dataclasses' type hints.

Supported hints: ``int``, ``float``, ``bool``, ``str``, ``X | None``, ``StrEnum`` subclasses
(matched by value), nested dataclasses (tables), ``tuple[X, ...]`` (arrays, e.g. arrays of
tables) and ``Mapping[str, Any]`` (kept as a deep read-only copy of the raw table). Anything else
is a programming error in the settings module and raises ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from types import MappingProxyType
from typing import Any

from config.errors import MISSING, IssueCollector

# Returned by the builders when a value is invalid; the issue has already been recorded.
INVALID: Any = object()

# Per-dataclass hooks that rewrite a table before it is built (e.g. role inheritance).
Prepare = Callable[[Mapping[str, Any]], Mapping[str, Any]]


@dataclasses.dataclass(slots=True)
class BuildContext:
    issues: IssueCollector
    # Raw text of env-var overrides by key path: "KVGATE__SERVER__ADMIN_TOKEN=1234" parses as
    # the integer 1234, but a string field must get the text "1234" back.
    raw_strings: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prepare: Mapping[type, Prepare] = dataclasses.field(default_factory=dict)


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def toml_type_name(value: Any) -> str:
    """The user-facing (TOML) name of a value's type."""
    if value is None:
        return "null"
    for typ, name in ((bool, "boolean"), (int, "integer"), (float, "float"), (str, "string")):
        if isinstance(value, typ):
            return name
    if isinstance(value, Mapping):
        return "table"
    if isinstance(value, list | tuple):
        return "array"
    return type(value).__name__


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def build_dataclass(cls: type, data: Any, path: str, ctx: BuildContext) -> Any:
    if not isinstance(data, Mapping):
        ctx.issues.add(path, data, f"must be a table, got {toml_type_name(data)}")
        return INVALID
    if cls in ctx.prepare:
        data = ctx.prepare[cls](data)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = _hints(cls)
    ok = True
    kwargs: dict[str, Any] = {}
    for key, raw in data.items():  # in file order, so errors read top to bottom
        key_path = _join(path, str(key))
        if key not in fields:
            ok = False
            ctx.issues.add(key_path, raw, _unknown_key_message(key, fields))
            continue
        value = coerce(hints[key], raw, key_path, ctx)
        if value is INVALID:
            ok = False
        else:
            kwargs[key] = value
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in data:
            ok = False
            ctx.issues.add(_join(path, name), MISSING, "missing required key")
    return cls(**kwargs) if ok else INVALID


def _unknown_key_message(key: Any, fields: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
    if close:
        return f'unknown key; did you mean "{close[0]}"?'
    return "unknown key; valid keys: " + ", ".join(fields)


def coerce(hint: Any, value: Any, path: str, ctx: BuildContext) -> Any:
    """Check ``value`` against ``hint`` and convert it; INVALID (issue recorded) on mismatch."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union type hint {hint!r} at {path}")
        return None if value is None else coerce(args[0], value, path, ctx)
    if origin is tuple:
        return _coerce_tuple(hint, value, path, ctx)
    if origin is Mapping or hint is Mapping:
        if not isinstance(value, Mapping):
            ctx.issues.add(path, value, f"must be a table, got {toml_type_name(value)}")
            return INVALID
        return freeze(value)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, path, ctx)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return _coerce_enum(hint, value, path, ctx)
    if hint in (bool, int, float, str):
        return _coerce_scalar(hint, value, path, ctx)
    raise TypeError(f"unsupported type hint {hint!r} at {path}")


def _coerce_tuple(hint: Any, value: Any, path: str, ctx: BuildContext) -> Any:
    args = typing.get_args(hint)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"only tuple[X, ...] is supported, got {hint!r} at {path}")
    if not isinstance(value, list | tuple):
        ctx.issues.add(path, value, f"must be an array, got {toml_type_name(value)}")
        return INVALID
    items = [coerce(args[0], item, f"{path}[{i}]", ctx) for i, item in enumerate(value)]
    return INVALID if any(item is INVALID for item in items) else tuple(items)


def _coerce_enum(hint: type[Enum], value: Any, path: str, ctx: BuildContext) -> Any:
    allowed = [str(m.value) for m in hint]
    if isinstance(value, str):
        # Case-insensitive so that KVGATE__ADMISSION__MODE=EARLY works as expected.
        for member in hint:
            if str(member.value).lower() == value.lower():
                return member
    message = "must be one of " + ", ".join(f'"{a}"' for a in allowed)
    if isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), allowed, n=1, cutoff=0.6)
        if close:
            message += f'; did you mean "{close[0]}"?'
    else:
        message += f", got {toml_type_name(value)}"
    ctx.issues.add(path, value, message)
    return INVALID


_EXPECTED = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _coerce_scalar(hint: type, value: Any, path: str, ctx: BuildContext) -> Any:
    if hint is str and not isinstance(value, str) and path in ctx.raw_strings:
        value = ctx.raw_strings[path]
    # bool is a subclass of int in Python, but `port = true` is a mistake, never a number.
    if isinstance(value, bool) and hint is not bool:
        ok = False
    elif hint is float:
        ok = isinstance(value, int | float)
    else:
        ok = isinstance(value, hint)
    if not ok:
        ctx.issues.add(path, value, f"must be {_EXPECTED[hint]}, got {toml_type_name(value)}")
        return INVALID
    if hint is float:
        value = float(value)
        if not math.isfinite(value):
            # nan compares false with everything and would slip through every range check.
            ctx.issues.add(path, value, "must be a finite number")
            return INVALID
    return value


def freeze(value: Any) -> Any:
    """Deep read-only copy: tables -> MappingProxyType, arrays -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def to_plain(value: Any) -> Any:
    """Inverse of building: dataclasses -> dicts, enums -> values, tuples -> lists.

    A ``None`` field whose default is ``None`` is omitted: TOML has no null, and leaving the key
    out means the same thing. Raw tables (``Mapping`` fields) are copied as they are.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if item is None and f.default is None:
                continue
            out[f.name] = to_plain(item)
        return out
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value
