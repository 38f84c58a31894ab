from __future__ import annotations

import pytest

from predictors.transfer import (
    DEFAULT_HOST_LINK_GBPS,
    DEFAULT_LATENCY_S,
    TransferModel,
    host_link_gbps,
)


def test_time_arithmetic() -> None:
    m = TransferModel(bytes_per_token=1000, bandwidth_bytes_per_s=1e6, latency_s=0.01)
    assert m.time(500) == pytest.approx(0.01 + 0.5)
    assert m.bytes_for(500) == 500_000


def test_inflight_bytes_queue_ahead() -> None:
    m = TransferModel(bytes_per_token=1000, bandwidth_bytes_per_s=1e6, latency_s=0.0)
    # 0.5 MB already on the link drains first (FIFO-like sharing).
    assert m.time(500, inflight_bytes=500_000) == pytest.approx(1.0)
    assert m.time(500, inflight_bytes=500_000) > m.time(500)


def test_zero_tokens_cost_nothing() -> None:
    m = TransferModel.from_gbps(131072, 200)
    assert m.time(0) == 0.0
    assert m.time(0, inflight_bytes=1e9) == 0.0


def test_from_gbps_is_gigabits() -> None:
    m = TransferModel.from_gbps(131072, 100.0)
    assert m.bandwidth_bytes_per_s == pytest.approx(12.5e9)
    assert m.latency_s == DEFAULT_LATENCY_S == 0.0005
    # 4096 tokens of Llama-3-8B KV (512 MiB) over 100 Gb/s: ~43 ms + latency.
    assert m.time(4096) == pytest.approx(0.0005 + 4096 * 131072 / 12.5e9)


def test_validation() -> None:
    with pytest.raises(ValueError):
        TransferModel(0, 1e9)
    with pytest.raises(ValueError):
        TransferModel(1, 0.0)
    with pytest.raises(ValueError):
        TransferModel(1, 1e9, latency_s=-1)


def test_host_link_follows_the_gpu_and_falls_back_to_the_slower_link() -> None:
    assert host_link_gbps("H200") == host_link_gbps("h100") == 400.0
    assert host_link_gbps("A100") == 200.0
    assert host_link_gbps("measured") == DEFAULT_HOST_LINK_GBPS == 200.0
