"""Per-tenant limits and fair sharing, pure: no clock (``now`` is an argument), no I/O.

- ``TokenBucket``: a rate limit with a burst. ``wait_s`` says how long until ``cost`` fits;
  a cost larger than the whole bucket is let through once the bucket is full (it leaves the
  bucket in debt) so that one big request is slowed down, never refused forever.
- ``FairShare``: each tenant's recent demand (the work of the requests it sent,
  exponentially decayed, half-life ``half_life_s``) against its weighted share of the tenants
  *active* (a request seen in the last ``active_window_s``). A tenant is over its share when,
  with ``work`` more added, its part of the recent demand exceeds
  ``weight / sum(weights of active tenants)``. A tenant alone is never over its share:
  sharing only starts when someone else wants capacity, so the fleet stays work-conserving.
  Demand rather than admitted work: at the start of a burst the bursting tenant has been
  admitted little yet and would look within its share just while it fills the queue; and
  demand rather than work in flight, because a tenant at a modest rate often has nothing in
  flight between two requests and would look idle.

The gateway (gateway/tenants.py) tightens the SLO admission of an over-share tenant; the
rule and its numbers are in docs/reliability.md, "Tenants".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """``rate_per_s`` refill, ``capacity`` burst; starts full."""

    rate_per_s: float
    capacity: float
    level: float = math.nan  # nan = full (set on first use)
    updated_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.capacity > 0):
            raise ValueError("a token bucket needs rate_per_s > 0 and capacity > 0")

    def _refill(self, now: float) -> None:
        if math.isnan(self.level):
            self.level, self.updated_s = self.capacity, now
            return
        if now > self.updated_s:  # a clock that steps back never drains the bucket
            self.level = min(self.capacity, self.level + (now - self.updated_s) * self.rate_per_s)
            self.updated_s = now

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` may be taken (0: now)."""
        self._refill(now)
        need = min(cost, self.capacity)  # more than the bucket holds: a full bucket will do
        return max(0.0, (need - self.level) / self.rate_per_s)

    def take(self, cost: float, now: float) -> None:
        self._refill(now)
        self.level -= cost


@dataclass(slots=True)
class _Usage:
    work: float = 0.0  # decayed demand, as of ``updated_s``
    updated_s: float = 0.0
    seen_s: float = -math.inf  # last request seen (admitted or not)


class FairShare:
    """Decayed per-tenant work and the weighted-share test (see the module docstring)."""

    __slots__ = ("_usage", "active_window_s", "half_life_s")

    def __init__(self, half_life_s: float = 5.0, active_window_s: float = 10.0) -> None:
        self.half_life_s = half_life_s
        self.active_window_s = active_window_s
        self._usage: dict[str, _Usage] = {}

    def configure(self, half_life_s: float, active_window_s: float) -> None:
        self.half_life_s = half_life_s
        self.active_window_s = active_window_s

    def _get(self, tenant: str, now: float) -> _Usage:
        u = self._usage.get(tenant)
        if u is None:
            u = self._usage[tenant] = _Usage(updated_s=now)
        elif now > u.updated_s:
            u.work *= 0.5 ** ((now - u.updated_s) / self.half_life_s)
            u.updated_s = now
        return u

    def seen(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` arrived: it is active for ``active_window_s``."""
        self._get(tenant, now).seen_s = now

    def used(self, tenant: str, work: float, now: float) -> None:
        """``tenant`` asked for ``work`` more (e.g. tokens)."""
        self._get(tenant, now).work += work

    def forget(self, tenant: str) -> None:
        self._usage.pop(tenant, None)

    def active(self, now: float) -> list[str]:
        return [t for t, u in self._usage.items() if now - u.seen_s <= self.active_window_s]

    def work(self, tenant: str, now: float) -> float:
        return self._get(tenant, now).work if tenant in self._usage else 0.0

    def shares(self, weights: Mapping[str, float], now: float) -> dict[str, tuple[float, float]]:
        """Active tenant -> (its part of the recent demand, its weighted share)."""
        active = self.active(now)
        total_w = sum(weights.get(t, 1.0) for t in active)
        total = sum(self.work(t, now) for t in active)
        return {
            t: (self.work(t, now) / total if total > 0 else 0.0, weights.get(t, 1.0) / total_w)
            for t in active
        }

    def over_share(
        self, tenant: str, work: float, weights: Mapping[str, float], now: float
    ) -> bool:
        """Whether admitting ``work`` more for ``tenant`` puts it above its weighted share."""
        active = self.active(now)
        if tenant not in active:
            active.append(tenant)
        if len(active) < 2:
            return False
        total = work + sum(self.work(t, now) for t in active)
        if total <= 0:
            return False
        total_w = sum(weights.get(t, 1.0) for t in active)
        mine = self.work(tenant, now) + work
        return mine / total > weights.get(tenant, 1.0) / total_w
