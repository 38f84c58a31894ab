"""Configuration errors that name the file (or env var), the dotted key path and the value.

Every problem found while loading is a ``ConfigIssue``; the loader collects all of them and
raises one ``ConfigError`` so a user fixes a config in one round trip instead of one per error.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final


class _Missing:
    """Sentinel for "no value" (a missing key), distinct from an explicit ``None``."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"  # pickles as the module-level singleton


MISSING: Final = _Missing()

# Values of these keys never appear in messages: errors end up in logs and admin API responses.
SECRET_KEYS: Final = frozenset({"server.admin_token"})

_MAX_VALUE_CHARS = 60


def format_path(parts: Sequence[str | int]) -> str:
    """``["pools", 1, "instances", 0, "url"]`` -> ``pools[1].instances[0].url``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else part
    return out


def format_value(value: Any) -> str:
    """Render a value the way it would be written in TOML, truncated for one-line messages."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    elif isinstance(value, float):
        # Ints in float fields were converted; show "-1" as the user wrote it, not "-1.0".
        integral = math.isfinite(value) and value.is_integer() and abs(value) < 1e15
        text = str(int(value)) if integral else repr(value)
    elif isinstance(value, Mapping):
        text = "{...}" if value else "{}"
    elif isinstance(value, list | tuple):
        text = f"[...{len(value)} items]" if value else "[]"
    elif value is None:
        text = "null"
    else:
        text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem: where it came from, which key, the offending value and what is wrong."""

    source: str  # file path, "<dict>", "<overrides>" or "env KVGATE__SLO__TTFT_S"
    key: str  # dotted path like "pools[1].instances[0].url"; "" for file-level problems
    value: Any  # MISSING when the key is absent (or the problem is not about one value)
    message: str

    def __str__(self) -> str:
        where = self.key
        if self.value is not MISSING and where:
            shown = "***" if self.key in SECRET_KEYS else format_value(self.value)
            where = f"{where} = {shown}"
        return (
            f"{self.source}: {where}: {self.message}" if where else f"{self.source}: {self.message}"
        )


class KvgateError(Exception):
    """Base of kvgate's own errors (bad config, trace, profile, model files, policy, prompt):
    an entry point catches this one type, plus OSError for the files it opens, instead of a
    tuple that grows with every module."""


class ConfigError(KvgateError):
    """Invalid configuration. ``source``/``key``/``value``/``message`` describe the first
    problem; ``errors`` holds every problem found (``str()`` shows them one per line)."""

    def __init__(self, source: str, key: str, value: Any, message: str) -> None:
        self._init_issues([ConfigIssue(source, key, value, message)])

    @classmethod
    def from_issues(cls, issues: Sequence[ConfigIssue]) -> ConfigError:
        if not issues:
            raise ValueError("ConfigError needs at least one issue")
        err = cls.__new__(cls)
        err._init_issues(issues)
        return err

    def _init_issues(self, issues: Sequence[ConfigIssue]) -> None:
        self.errors: tuple[ConfigIssue, ...] = tuple(issues)
        first = self.errors[0]
        self.source = first.source
        self.key = first.key
        self.value = first.value
        self.message = first.message
        super().__init__("\n".join(str(i) for i in self.errors))

    def __reduce__(self) -> tuple[Any, ...]:
        # Default exception pickling re-calls __init__ with self.args, which would lose issues.
        return (ConfigError.from_issues, (self.errors,))


class IssueCollector:
    """Collects issues, attributing each key to whoever set it last (file, env var, override).

    ``origins`` maps a dotted key path to a source label; a key inherits the label of its
    nearest overridden ancestor (an override of ``pools`` owns ``pools[0].url`` too).
    """

    def __init__(self, default_source: str, origins: Mapping[str, str] | None = None) -> None:
        self.default_source = default_source
        self.origins = dict(origins or {})
        self.issues: list[ConfigIssue] = []

    def origin(self, key: str) -> str | None:
        owners = [p for p in self.origins if key == p or key.startswith((p + ".", p + "["))]
        return self.origins[max(owners, key=len)] if owners else None

    def source_for(self, key: str) -> str:
        return self.origin(key) or self.default_source

    def add(self, key: str, value: Any, message: str) -> None:
        self.issues.append(ConfigIssue(self.source_for(key), key, value, message))

    def add_issue(self, issue: ConfigIssue) -> None:
        self.issues.append(issue)

    def raise_if_any(self) -> None:
        if self.issues:
            raise ConfigError.from_issues(self.issues)
