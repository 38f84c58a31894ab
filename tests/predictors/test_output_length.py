from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.settings import PredictorSettings
from predictors.output_length import OutputLengthPredictor, _Window, quantile


def make(**kw: int | float) -> OutputLengthPredictor:
    args: dict = {"history": 8, "quantile": 0.5, "default_tokens": 256, **kw}
    return OutputLengthPredictor(**args)


def test_default_before_any_observation() -> None:
    p = make()
    assert p.predict(None, 4096) == 256
    assert p.predict(123, 4096) == 256
    assert p.predict(123, 100) == 100  # clamped to max_tokens


def test_per_key_median() -> None:
    p = make()
    for v in (10, 20, 30):
        p.observe(1, v)
    for v in (1000, 2000, 3000):
        p.observe(2, v)
    assert p.predict(1, 10_000) == 20
    assert p.predict(2, 10_000) == 2000


def test_unknown_and_none_keys_fall_back_to_global() -> None:
    p = make(global_refresh=1)
    for v in (100, 200, 300):
        p.observe(None, v)
    assert p.predict(None, 10_000) == 200
    assert p.predict(42, 10_000) == 200
    assert 42 not in p


def test_clamped_to_one_and_max_tokens() -> None:
    p = make()
    p.observe(7, 0)
    assert p.predict(7, 100) == 1  # never predict zero output
    p.observe(8, 5000)
    assert p.predict(8, 300) == 300
    assert p.predict(8, 0) == 1


def test_history_window_is_bounded_and_recent() -> None:
    p = make(history=4)
    for _ in range(100):
        p.observe(1, 1000)
    for _ in range(4):
        p.observe(1, 10)
    assert p.predict(1, 10_000) == 10  # old outputs fell out of the window


def test_lru_eviction_bounds_keys() -> None:
    p = make(max_keys=3, global_refresh=1)
    for key in (1, 2, 3):
        p.observe(key, key * 100)
    p.observe(1, 100)  # refresh key 1: key 2 is now the least recently observed
    p.observe(4, 400)
    assert p.tracked_keys == 3
    assert 2 not in p and 1 in p and 3 in p and 4 in p
    # Evicted key falls back to the global estimate.
    assert p.predict(2, 10_000) == p.predict(None, 10_000)
    for key in range(1000):
        p.observe(key, 10)
    assert p.tracked_keys == 3


def test_global_estimate_refreshes_every_k_observations() -> None:
    p = make(global_refresh=5, global_window=100)
    p.observe(None, 10)  # first observation sets the global estimate immediately
    assert p.predict(None, 10_000) == 10
    for _ in range(4):
        p.observe(None, 1000)
    assert p.predict(None, 10_000) == 10  # not refreshed yet (4 since last refresh)
    p.observe(None, 1000)
    assert p.predict(None, 10_000) == 1000


def test_global_window_is_bounded() -> None:
    p = make(global_window=10, global_refresh=1)
    for _ in range(50):
        p.observe(None, 5)
    for _ in range(10):
        p.observe(None, 500)
    assert p.predict(None, 10_000) == 500


def test_quantile_parameter() -> None:
    p = make(history=100, quantile=0.9)
    for v in range(1, 101):
        p.observe(1, v)
    assert p.predict(1, 10_000) == 90


def test_validation_and_from_settings() -> None:
    with pytest.raises(ValueError):
        make(history=0)
    with pytest.raises(ValueError):
        make(quantile=1.5)
    with pytest.raises(ValueError):
        make(default_tokens=0)
    with pytest.raises(ValueError):
        make().observe(1, -1)
    p = OutputLengthPredictor.from_settings(PredictorSettings())
    assert (p.history, p.quantile, p.default_tokens) == (64, 0.5, 256)


@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=64), st.floats(0.0, 1.0))
def test_quantile_matches_numpy(values: list[int], q: float) -> None:
    expected = float(np.quantile(np.array(values, dtype=np.float64), q))
    assert abs(quantile(values, q) - expected) <= 0.5 + 1e-6


@settings(max_examples=100)
@given(
    values=st.lists(st.integers(0, 5000), min_size=1, max_size=200),
    size=st.integers(1, 40),
    q=st.floats(0.0, 1.0),
)
def test_sliding_window_quantile_equals_sorting_the_last_values(
    values: list[int], size: int, q: float
) -> None:
    w = _Window(size)
    for i, v in enumerate(values):
        w.add(v)
        last = values[max(0, i + 1 - size) : i + 1]
        assert len(w) == len(last) and w.quantile(q) == quantile(last, q)


@settings(max_examples=100, deadline=None)
@given(
    obs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5000)), min_size=1, max_size=80),
    history=st.integers(1, 6),
    q=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]),
)
def test_per_key_estimates_equal_the_quantile_of_each_keys_last_outputs(
    obs: list[tuple[int, int]], history: int, q: float
) -> None:
    """A key seen once is kept as a bare int, promoted to a window when it comes back: the
    estimates are those of one window per key from the start."""
    p = make(history=history, quantile=q)
    seen: dict[int, list[int]] = {}
    for key, out in obs:
        p.observe(key, out)
        seen.setdefault(key, []).append(out)
        assert p.predict(key, 10**6) == max(1, quantile(seen[key][-history:], q))


def test_a_key_seen_once_costs_a_fraction_of_a_window() -> None:
    import tracemalloc

    p = make(history=64)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in range(5000):
            p.observe(10**12 + key, 64 + key % 100)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / 5000
    finally:
        tracemalloc.stop()
    assert per_key < 300  # ~120 B; a window per key was ~1,070 B
