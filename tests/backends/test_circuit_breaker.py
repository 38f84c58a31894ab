"""backends/circuit_breaker.py: the breaker's state machine, the caller's clock passed in."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.circuit_breaker import BreakerConfig, BreakerState, CircuitBreaker


def test_defaults_are_the_sglang_gateway_numbers() -> None:
    assert BreakerConfig() == BreakerConfig(
        failure_threshold=10, window_s=120.0, open_s=60.0, success_threshold=3
    )
    fast = BreakerConfig.fast()
    assert fast.open_s <= 0.1 and fast.failure_threshold <= 3


@pytest.mark.parametrize(
    "kwargs",
    [{"failure_threshold": 0}, {"success_threshold": 0}, {"window_s": 0}, {"open_s": -1}],
)
def test_invalid_config_is_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BreakerConfig(**kwargs)  # type: ignore[arg-type]


def test_trips_after_threshold_failures_within_the_window() -> None:
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, window_s=10, open_s=5))
    cb.record_failure(0.0)
    cb.record_success(1.0)  # successes do not forgive failures inside the window
    cb.record_failure(2.0)
    assert cb.state is BreakerState.CLOSED and cb.allow(2.0)
    cb.record_failure(9.0)
    assert cb.state is BreakerState.OPEN and not cb.allow(9.0) and cb.opened_count == 1


def test_failures_older_than_the_window_do_not_count() -> None:
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, window_s=10, open_s=5))
    for t in (0.0, 6.0, 12.0, 18.0):  # never 3 inside any 10 s
        cb.record_failure(t)
    assert cb.state is BreakerState.CLOSED
    cb.record_failure(19.0)
    assert cb.state is BreakerState.OPEN


def test_open_then_half_open_then_closed() -> None:
    cfg = BreakerConfig(failure_threshold=2, window_s=10, open_s=5, success_threshold=3)
    cb = CircuitBreaker(cfg)
    cb.record_failure(0.0)
    cb.record_failure(1.0)
    assert not cb.allow(5.9)
    cb.record_failure(5.0)  # straggler while open: does not push the reopening back
    assert cb.state_at(6.0) is BreakerState.HALF_OPEN and cb.allow(6.0)
    cb.record_success(6.1)
    cb.record_success(6.2)
    assert cb.state is BreakerState.HALF_OPEN
    cb.record_success(6.3)
    assert cb.state is BreakerState.CLOSED
    cb.record_failure(6.4)  # the old failures were cleared on closing
    assert cb.state is BreakerState.CLOSED


def test_any_failure_in_half_open_reopens() -> None:
    cb = CircuitBreaker(BreakerConfig(failure_threshold=1, window_s=10, open_s=5))
    cb.record_failure(0.0)
    cb.record_success(5.0)  # the open timeout passed: counts as a trial success
    assert cb.state is BreakerState.HALF_OPEN
    cb.record_failure(5.5)
    assert cb.state is BreakerState.OPEN and not cb.allow(10.4) and cb.allow(10.5)
    assert cb.opened_count == 2


def test_fast_preset_recovers_quickly() -> None:
    cb = CircuitBreaker(BreakerConfig.fast())
    for i in range(3):
        cb.record_failure(i * 0.01)
    assert not cb.allow(0.05) and cb.allow(0.13)
    cb.record_success(0.14)
    cb.record_success(0.15)
    assert cb.state is BreakerState.CLOSED


@given(st.lists(st.tuples(st.floats(0, 5), st.booleans()), max_size=60))
def test_open_is_the_only_state_that_refuses(steps: list[tuple[float, bool]]) -> None:
    cb = CircuitBreaker(BreakerConfig(failure_threshold=3, window_s=2, open_s=1))
    now = 0.0
    for dt, ok in steps:
        now += dt
        assert cb.allow(now) == (cb.state is not BreakerState.OPEN)
        (cb.record_success if ok else cb.record_failure)(now)


def test_trip_opens_the_breaker_at_once_and_stragglers_do_not_extend_it() -> None:
    cb = CircuitBreaker(BreakerConfig(failure_threshold=10, window_s=60, open_s=5))
    cb.trip(1.0)
    assert cb.state_at(1.0) is BreakerState.OPEN and cb.opened_count == 1
    cb.trip(3.0)  # already open: same period, not counted twice
    assert cb.opened_count == 1
    assert cb.state_at(6.0) is BreakerState.HALF_OPEN  # 5 s after the first trip
