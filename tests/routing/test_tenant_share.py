"""Token buckets and the weighted fair-share test (routing/tenant_share.py): time is passed in."""

from __future__ import annotations

import pytest

from routing.tenant_share import FairShare, TokenBucket


def test_bucket_starts_full_refills_at_its_rate_and_says_how_long_to_wait() -> None:
    b = TokenBucket(rate_per_s=2.0, capacity=4.0)
    for _ in range(4):
        assert b.wait_s(1, now=10.0) == 0.0
        b.take(1, now=10.0)
    assert b.wait_s(1, now=10.0) == pytest.approx(0.5)  # one token at 2/s
    assert b.wait_s(1, now=10.25) == pytest.approx(0.25)
    assert b.wait_s(1, now=10.5) == 0.0
    assert b.wait_s(3, now=10.5) == pytest.approx(1.0)
    # Refill stops at the capacity: a long pause does not bank more than the burst.
    assert b.wait_s(4, now=1000.0) == 0.0
    b.take(4, now=1000.0)
    assert b.wait_s(1, now=1000.0) == pytest.approx(0.5)


def test_a_cost_beyond_the_burst_passes_on_a_full_bucket_and_leaves_a_debt() -> None:
    b = TokenBucket(rate_per_s=100.0, capacity=100.0)
    assert b.wait_s(250, now=0.0) == 0.0  # full: the big request goes through once
    b.take(250, now=0.0)
    assert b.level == pytest.approx(-150.0)
    assert b.wait_s(1, now=0.0) == pytest.approx(1.51)  # the debt is paid back first


def test_a_clock_stepping_back_does_not_drain_or_fill() -> None:
    b = TokenBucket(rate_per_s=1.0, capacity=2.0)
    b.take(2, now=5.0)
    assert b.wait_s(1, now=4.0) == pytest.approx(1.0)
    assert b.wait_s(1, now=6.0) == 0.0


def test_bucket_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0.0, 1.0)
    with pytest.raises(ValueError):
        TokenBucket(1.0, -1.0)


def test_a_tenant_alone_is_never_over_its_share() -> None:
    fs = FairShare(half_life_s=5.0, active_window_s=10.0)
    fs.seen("a", 0.0)
    fs.used("a", 1e6, 0.0)
    assert not fs.over_share("a", 1000.0, {"a": 1.0}, 0.0)


def test_weighted_share_among_active_tenants() -> None:
    fs = FairShare(half_life_s=5.0, active_window_s=10.0)
    weights = {"a": 1.0, "b": 3.0}  # b is entitled to 3/4
    fs.seen("a", 0.0)
    fs.seen("b", 0.0)
    fs.used("a", 300.0, 0.0)
    fs.used("b", 600.0, 0.0)
    assert fs.over_share("a", 10.0, weights, 0.0)  # 310/910 > 1/4
    assert not fs.over_share("b", 10.0, weights, 0.0)  # 610/910 < 3/4
    # A tenant that sent a request but got nothing admitted still counts: the other is over.
    fs2 = FairShare()
    fs2.seen("a", 0.0)
    fs2.used("a", 100.0, 0.0)
    fs2.seen("b", 0.0)
    assert fs2.over_share("a", 1.0, {}, 0.0)
    assert not fs2.over_share("b", 1.0, {}, 0.0)


def test_idle_tenants_drop_out_and_old_work_decays() -> None:
    fs = FairShare(half_life_s=2.0, active_window_s=10.0)
    fs.seen("a", 0.0)
    fs.seen("b", 0.0)
    fs.used("a", 100.0, 0.0)
    assert fs.work("a", 2.0) == pytest.approx(50.0)  # one half-life
    assert fs.over_share("a", 1.0, {}, 5.0)  # b still active
    fs.seen("a", 11.0)  # b silent for 11 s > window: a is alone again
    assert fs.active(11.0) == ["a"]
    assert not fs.over_share("a", 1.0, {}, 11.0)
    shares = FairShare()
    shares.seen("x", 0.0)
    shares.seen("y", 0.0)
    shares.used("x", 30.0, 0.0)
    shares.used("y", 10.0, 0.0)
    assert shares.shares({"x": 1.0, "y": 1.0}, 0.0) == {"x": (0.75, 0.5), "y": (0.25, 0.5)}
