from __future__ import annotations

import pytest

from replay.engine.network import Network


def test_transfer_time_and_contention() -> None:
    n = Network(1e9, latency_s=0.0)
    assert n.transfer("a", "b", 1e9, 0.0) == pytest.approx(1.0)
    # b's inbound link is busy until 1.0: a second transfer into b waits.
    assert n.transfer("c", "b", 5e8, 0.5) == pytest.approx(1.5)
    # Unrelated links do not wait.
    assert n.transfer("d", "e", 5e8, 0.5) == pytest.approx(1.0)
    assert n.bytes_moved == pytest.approx(2e9)
    assert n.transfer("a", "a", 1e9, 2.0) == 2.0  # local: free


def test_a_transfer_waiting_for_its_destination_does_not_block_its_source() -> None:
    n = Network(1e9, latency_s=0.0)
    assert n.transfer("a", "b", 1e9, 0.0) == pytest.approx(1.0)  # b's inbound: [0, 1)
    # x -> b must wait for b: reserved [1, 2) on x's outbound and b's inbound.
    assert n.transfer("x", "b", 1e9, 0.1) == pytest.approx(2.0)
    # x's outbound is free before 1: a transfer elsewhere uses that gap (a FIFO per link
    # would have queued it behind x -> b, until 2.5).
    assert n.transfer("x", "y", 5e8, 0.2) == pytest.approx(0.7)
    # Too long for the gap [0.7, 1): it goes after the reservation that ends at 2.
    assert n.transfer("x", "z", 5e8, 0.3) == pytest.approx(2.5)
    # A gap must be free on both ends: y's inbound [0.2, 0.7) pushes this one to 0.7.
    assert n.transfer("w", "y", 2e8, 0.3) == pytest.approx(0.9)


def test_reservations_in_the_past_are_forgotten() -> None:
    n = Network(1e9, latency_s=0.0)
    for i in range(100):
        n.transfer("a", f"d{i}", 1e6, float(i))
    assert n.transfer("a", "b", 1e6, 1000.0) == pytest.approx(1000.001)
    assert len(n._busy[("out", "a")]) == 1  # a link keeps only what has not ended
