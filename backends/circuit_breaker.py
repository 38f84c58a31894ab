"""Per-instance circuit breaker over real traffic's outcomes: a pure state machine, the caller's
clock passed in (backends/health.py pairs it with active ``/health`` polling).

Closed counts failures inside a window and opens at a threshold; open refuses traffic until
its timeout, then half-open lets trial traffic through: enough successes close it, one
failure reopens it. A refused connection opens it at once (``trip``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"  # traffic flows
    OPEN = "open"  # traffic refused until open_s has passed
    HALF_OPEN = "half_open"  # trial traffic; successes close it, one failure reopens it


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Defaults are SGLang model gateway's (reference/peer-routers.md sections 1.4 and 14)."""

    failure_threshold: int = 10
    window_s: float = 120.0
    open_s: float = 60.0
    success_threshold: int = 3

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ValueError("failure_threshold and success_threshold must be >= 1")
        if self.window_s <= 0 or self.open_s <= 0:
            raise ValueError("window_s and open_s must be positive")

    @classmethod
    def fast(cls) -> BreakerConfig:
        """Small numbers for tests and the emulated fleet: trips and recovers in ~0.1 s."""
        return cls(failure_threshold=3, window_s=1.0, open_s=0.1, success_threshold=2)


class CircuitBreaker:
    """Pure state machine; every method takes the caller's clock."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.config = config if config is not None else BreakerConfig()
        self._state = BreakerState.CLOSED
        self._failures: deque[float] = deque()  # failure times inside the window (CLOSED)
        self._opened_at = 0.0
        self._trial_successes = 0
        self.opened_count = 0  # how often it tripped, for metrics

    @property
    def state(self) -> BreakerState:
        """State as of the last call; use ``state_at`` to also apply the open timeout."""
        return self._state

    def state_at(self, now: float) -> BreakerState:
        if self._state is BreakerState.OPEN and now - self._opened_at >= self.config.open_s:
            self._state = BreakerState.HALF_OPEN
            self._trial_successes = 0
        return self._state

    def allow(self, now: float) -> bool:
        return self.state_at(now) is not BreakerState.OPEN

    def record_success(self, now: float) -> None:
        if self.state_at(now) is BreakerState.HALF_OPEN:
            self._trial_successes += 1
            if self._trial_successes >= self.config.success_threshold:
                self._state = BreakerState.CLOSED
                self._failures.clear()
        # In CLOSED a success does not forgive earlier failures: the threshold counts
        # failures per window, so an instance failing every other request still trips.
        # In OPEN it is a straggler that was admitted before the breaker opened.

    def record_failure(self, now: float) -> None:
        state = self.state_at(now)
        if state is BreakerState.HALF_OPEN:
            self._open(now)
        elif state is BreakerState.CLOSED:
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.config.window_s:
                self._failures.popleft()
            if len(self._failures) >= self.config.failure_threshold:
                self._open(now)
        # In OPEN: stragglers must not extend the open period, or it would never end.

    def recent_failures(self, now: float) -> int:
        """Failures counted inside the window (CLOSED; an open breaker has cleared them)."""
        return sum(1 for t in self._failures if now - t <= self.config.window_s)

    def trip(self, now: float) -> None:
        """Open now, whatever the count (the engine refused a connection: it is down)."""
        if self.state_at(now) is not BreakerState.OPEN:
            self._open(now)

    def _open(self, now: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = now
        self._failures.clear()
        self._trial_successes = 0
        self.opened_count += 1
