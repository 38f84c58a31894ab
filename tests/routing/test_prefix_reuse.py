"""The reuse measurement behind best-effort admission: settled at the horizon, bounded."""

from __future__ import annotations

import pytest

from routing.prefix_reuse import PrefixReuse
from tests.routing.fleet import prompt


def test_starts_undecided_at_one_in_two() -> None:
    r = PrefixReuse(horizon_s=10.0)
    assert r.rate == 0.5 and r.settled == 0 and r.watched == 0


def test_an_extension_counts_only_when_its_horizon_ends() -> None:
    r = PrefixReuse(horizon_s=10.0)
    r.watch(prompt(1, 20), 0.0)
    r.observe(prompt(1, 30), 5.0)  # the next turn: the whole earlier prompt and more
    assert r.settled == 0 and r.rate == 0.5  # settling it now would bias the rate up
    r.observe(prompt(9, 3), 10.0)
    assert r.settled == 1 and r.rate == pytest.approx(2 / 3)


def test_a_prompt_nobody_extends_counts_as_not_reused() -> None:
    r = PrefixReuse(horizon_s=10.0)
    r.watch(prompt(1, 20), 0.0)
    r.observe(prompt(2, 40), 5.0)  # another family: no extension
    r.observe(prompt(2, 40), 10.5)
    assert r.settled == 1 and r.rate == pytest.approx(1 / 3)


def test_the_last_partial_block_may_differ() -> None:
    """A follow-up repeats the earlier prompt; its trailing block may not (90 % cover)."""
    r = PrefixReuse(horizon_s=10.0)
    r.watch(prompt(1, 20), 0.0)
    r.observe((*prompt(1, 18), 555, 556), 1.0)  # the first 18 of 20 blocks
    r.observe((), 11.0)
    assert r.rate == pytest.approx(2 / 3)
    r.watch(prompt(3, 20), 20.0)
    r.observe((*prompt(3, 17), 777), 21.0)  # 17 of 20: below 90 %
    r.observe((), 31.0)
    assert r.rate == pytest.approx(2 / 4)


def test_a_repeat_of_the_same_prompt_is_a_reuse_and_not_watched_twice() -> None:
    r = PrefixReuse(horizon_s=10.0)
    r.watch(prompt(1, 20), 0.0)
    r.observe(prompt(1, 20), 3.0)
    r.watch(prompt(1, 20), 3.0)
    assert r.watched == 1
    r.observe((), 10.0)
    assert r.settled == 1 and r.rate == pytest.approx(2 / 3)


def test_watching_is_bounded_and_the_window_slides() -> None:
    r = PrefixReuse(horizon_s=1e9, capacity=4, window=8)
    for i in range(20):
        r.watch(prompt(i, 10), float(i))
    assert r.watched == 4 and r.settled == 8  # 16 pushed out unextended; the rate keeps 8
    assert r.rate == pytest.approx(1 / 10)
    for i in range(16, 20):
        r.observe(prompt(i, 12), 30.0)
    for i in range(20, 24):
        r.watch(prompt(i, 10), float(i))  # pushes out the four extended ones
    assert r.rate == pytest.approx((4 + 1) / (8 + 2))


def test_empty_prompts_are_ignored_and_bad_arguments_refused() -> None:
    r = PrefixReuse()
    r.watch((), 0.0)
    assert r.watched == 0
    with pytest.raises(ValueError):
        PrefixReuse(horizon_s=0)
    with pytest.raises(ValueError):
        PrefixReuse(capacity=0)
