"""KV-cache movement time: instance-to-instance links, host-memory and shared-store loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

DEFAULT_LATENCY_S = 0.0005  # per transfer setup (RDMA handshake / request round trip)
# Host memory -> GPU over the card's PCIe link, as an engine loads a host-tier prefix (one bulk
# copy of pinned memory, then a scatter into its pages): 50.2-50.8 GB/s measured on an H200
# (PCIe Gen5 x16) for 1k-16k tokens of Llama-3-8B KV (docs/gpu-step-times.md, "Host tier");
# the H100 has the same link. The A100's Gen4 link moves half that (not measured here).
HOST_LINK_GBPS = MappingProxyType({"H100": 400.0, "H200": 400.0, "A100": 200.0})
DEFAULT_HOST_LINK_GBPS = 200.0  # a GPU not listed above: the slower link


def host_link_gbps(gpu: str) -> float:
    """Gigabits/s an engine on ``gpu`` loads host-tier KV at (``predictors.host_load_gbps``
    overrides it)."""
    return HOST_LINK_GBPS.get(gpu.upper(), DEFAULT_HOST_LINK_GBPS)


@dataclass(frozen=True, slots=True)
class TransferModel:
    """``time = latency + (tokens*bytes_per_token + inflight_bytes) / bandwidth``.

    ``inflight_bytes`` are transfers already queued on the same link: sharing it FIFO-like, the
    new transfer finishes after they drain, so they add to its bytes rather than to a rate split.
    """

    bytes_per_token: int
    bandwidth_bytes_per_s: float
    latency_s: float = DEFAULT_LATENCY_S
    _inv_bw: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:
            raise ValueError("bytes_per_token must be > 0")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError("bandwidth_bytes_per_s must be > 0")
        if self.latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        object.__setattr__(self, "_inv_bw", 1.0 / self.bandwidth_bytes_per_s)

    @classmethod
    def from_gbps(
        cls, bytes_per_token: int, gbps: float, latency_s: float = DEFAULT_LATENCY_S
    ) -> TransferModel:
        """``gbps`` in gigabits/s (network convention, 1e9 bits), converted to bytes/s."""
        return cls(bytes_per_token, gbps * 1e9 / 8.0, latency_s)

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def time(self, tokens: int, inflight_bytes: float = 0.0) -> float:
        """Seconds to move ``tokens`` of KV; nothing to move costs nothing (no latency)."""
        if tokens <= 0:
            return 0.0
        return self.latency_s + (tokens * self.bytes_per_token + inflight_bytes) * self._inv_bw
