"""Collects validation problems with the key path and value of each: the small vocabulary
every section's checks are written in (config/checks.py, tenant_checks.py,
replica_checks.py)."""

from __future__ import annotations

from typing import Any

from config.errors import IssueCollector


class Checker:
    def __init__(self, issues: IssueCollector) -> None:
        self.issues = issues

    def require(self, ok: bool, key: str, value: Any, message: str) -> None:
        if not ok:
            self.issues.add(key, value, message)

    def positive(self, key: str, value: float | None) -> None:
        if value is not None:
            self.require(value > 0, key, value, "must be > 0")

    def at_least(self, key: str, value: float | None, low: float) -> None:
        if value is not None:
            self.require(value >= low, key, value, f"must be >= {low}")

    def between(self, key: str, value: float | None, low: float, high: float) -> None:
        if value is not None:
            self.require(low <= value <= high, key, value, f"must be in {low}..{high}")

    def fraction(self, key: str, value: float) -> None:
        self.require(0.0 <= value < 1.0, key, value, "must be in [0, 1)")

    def non_empty(self, key: str, value: str | None) -> None:
        if value is not None:
            self.require(value.strip() != "", key, value, "must not be empty")

    def ordered(self, low_key: str, low: float, high_key: str, high: float) -> None:
        """low <= high, reported on whichever key an override set (that is what changed)."""
        if low <= high:
            return
        if self.issues.origin(high_key) and not self.issues.origin(low_key):
            self.issues.add(high_key, high, f"must be >= {low_key} ({low})")
        else:
            self.issues.add(low_key, low, f"must be <= {high_key} ({high})")

    def unique(
        self, key: str, value: Any, seen: dict[Any, str], what: str, norm: Any = None
    ) -> None:
        """``value`` (compared as ``norm`` when given) must not have been seen before."""
        ident = value if norm is None else norm
        if ident in seen:
            self.issues.add(key, value, f"duplicate {what} (also at {seen[ident]})")
        else:
            seen[ident] = key
