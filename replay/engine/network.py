"""KV transfers between instances: one full-duplex NIC per instance, FIFO on each direction.

A transfer of ``nbytes`` from s to d starts when both s's outbound and d's inbound queues are
free and takes nbytes / bandwidth + latency; transfers in flight delay later ones (contention).
"""

from __future__ import annotations


class Network:
    __slots__ = ("_in", "_out", "bandwidth", "bytes_moved", "latency_s")

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0005) -> None:
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self._out: dict[str, float] = {}
        self._in: dict[str, float] = {}
        self.bytes_moved = 0.0

    def transfer(self, source: str, destination: str, nbytes: float, now: float) -> float:
        """Reserve the links; returns when the last byte arrives."""
        if nbytes <= 0 or source == destination:
            return now
        start = max(now, self._out.get(source, 0.0), self._in.get(destination, 0.0))
        end = start + nbytes / self.bandwidth
        self._out[source] = end
        self._in[destination] = end
        self.bytes_moved += nbytes
        return end + self.latency_s
