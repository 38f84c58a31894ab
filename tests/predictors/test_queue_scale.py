"""The learned queue-wait correction: where it learns, how fast, and its bounds."""

from __future__ import annotations

import math

import pytest

from predictors.queue_scale import MAX_SCALE, MIN_SCALE, QueueScale


def test_it_converges_to_the_ratio_the_engine_shows() -> None:
    q = QueueScale(rate=0.1)
    raw = 0.5  # what the books predict, unscaled
    for _ in range(200):
        assert q.observe(raw * q.scale, 0.6 * q.scale, 1.3 * raw)  # waits take 1.3x the books
    assert q.scale == pytest.approx(1.3, rel=1e-3) and q.samples == 200


def test_one_step_moves_it_by_the_rate_times_the_log_error() -> None:
    q = QueueScale(rate=0.05)
    q.observe(1.0, 1.2, 2.0)
    assert q.log_scale == pytest.approx(0.05 * math.log(2.0))
    q2 = QueueScale(rate=0.05)
    q2.observe(1.0, 1.2, 1000.0)  # a wild answer counts as at most 8x
    assert q2.log_scale == pytest.approx(0.05 * math.log(8.0))


@pytest.mark.parametrize(
    ("queue", "ttft"),
    [(0.005, 0.006), (0.02, 0.2)],  # under 10 ms; under a quarter of the TTFT
)
def test_small_predicted_waits_teach_nothing(queue: float, ttft: float) -> None:
    q = QueueScale(rate=0.5)
    assert not q.observe(queue, ttft, 10 * queue)
    assert q.scale == 1.0 and q.samples == 0


def test_it_stays_within_its_bounds() -> None:
    up, down = QueueScale(rate=1.0), QueueScale(rate=1.0)
    for _ in range(10):
        up.observe(1.0, 1.0, 100.0)
        down.observe(1.0, 1.0, 0.0)
    assert up.scale == pytest.approx(MAX_SCALE) and down.scale == pytest.approx(MIN_SCALE)
