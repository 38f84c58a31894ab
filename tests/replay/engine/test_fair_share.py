from __future__ import annotations

import pytest

from replay.engine.fair_share import FairShareNetwork, max_min_rates
from replay.engine.network import NETWORK_MODELS, Network


def test_two_transfers_on_one_link_share_it_and_the_survivor_speeds_up() -> None:
    n = FairShareNetwork(1e9, latency_s=0.0)
    assert n.start(1, "a", "b", 1e9, 0.0) == [(1, pytest.approx(1.0))]
    # From 0.5 s both leave a's outbound link at half rate: flow 1 has 0.5 GB left, 1 s more.
    moved = dict(n.start(2, "a", "c", 2e8, 0.5))
    assert moved == {1: pytest.approx(1.5), 2: pytest.approx(0.9)}
    # The short one is done at 0.9 (a calendar would have held it until 1.2); the long
    # one then has 0.3 GB left alone on the link.
    assert dict(n.finish(2, 0.9)) == {1: pytest.approx(1.2)}
    assert n.finish(1, 1.2) == [] and n.in_flight == 0
    assert n.bytes_moved == pytest.approx(1.2e9)


def test_a_transfer_limited_elsewhere_leaves_its_share_to_the_others() -> None:
    # Into b: 3 flows share b's inbound (1/3 each). x -> b's source x also sends to y, whose
    # flow gets what x's outbound has left: 2/3, not 1/2.
    rates = max_min_rates(
        {
            1: (("out", "p"), ("in", "b")),
            2: (("out", "q"), ("in", "b")),
            3: (("out", "x"), ("in", "b")),
            4: (("out", "x"), ("in", "y")),
        },
        capacity=3.0,
    )
    assert rates == {1: pytest.approx(1.0), 2: pytest.approx(1.0), 3: 1.0, 4: 2.0}


def test_unrelated_links_do_not_slow_each_other_and_local_moves_are_free() -> None:
    n = FairShareNetwork(1e9, latency_s=0.001)
    n.start(1, "a", "b", 1e9, 0.0)
    assert n.start(2, "c", "d", 5e8, 0.0) == [(2, pytest.approx(0.501))]
    assert n.start(3, "a", "a", 1e9, 0.2) == [(3, 0.2)]
    assert n.finish(3, 0.2) == []


def test_both_link_models_are_registered() -> None:
    assert NETWORK_MODELS["fair"] is FairShareNetwork and NETWORK_MODELS["calendar"] is Network
    cal = Network(1e9, latency_s=0.0)
    assert cal.start(7, "a", "b", 1e9, 0.0) == [(7, pytest.approx(1.0))]
    assert cal.finish(7, 1.0) == []  # a reservation never moves
