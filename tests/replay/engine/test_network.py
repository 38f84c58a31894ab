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
