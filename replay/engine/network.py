"""KV transfers between instances: the ``Links`` seam the simulator times them through, and
the calendar model (one full-duplex NIC per instance, each direction a calendar).

A transfer of ``nbytes`` from s to d takes nbytes / bandwidth + latency on both s's outbound and
d's inbound link, in the earliest interval from ``now`` on where both are free: it fills a gap
left by earlier reservations instead of queueing behind the latest one. (A FIFO per link made a
source idle while one transfer waited for its busy destination, and the wait cascaded across
the fleet: at a quarter of the links' capacity some KV waited a minute.) One transfer at a
time per link: a short KV waits behind a long one. ``replay/engine/fair_share.py`` shares the
bandwidth instead, as NICs do; ``NETWORK_MODELS`` names both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sortedcontainers import SortedList

from replay.engine.fair_share import FairShareNetwork


class Links(Protocol):
    """How the simulator times KV transfers. ``start`` and ``finish`` return (flow, end) for
    every transfer whose end is new or moved; the simulator (re)schedules those and calls
    ``finish`` when a scheduled end comes due."""

    bytes_moved: float

    def start(
        self, flow: int, source: str, destination: str, nbytes: float, now: float
    ) -> list[tuple[int, float]]: ...

    def finish(self, flow: int, now: float) -> list[tuple[int, float]]: ...


class Network:
    """Calendar links: each transfer reserved whole, up front (``Links``; the live emulator
    times its transfers once, with ``transfer``)."""

    __slots__ = ("_busy", "bandwidth", "bytes_moved", "latency_s")

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0005) -> None:
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        # (direction, instance) -> reserved (start, end) intervals, disjoint, sorted
        self._busy: dict[tuple[str, str], SortedList] = {}
        self.bytes_moved = 0.0

    def transfer(self, source: str, destination: str, nbytes: float, now: float) -> float:
        """Reserve the links; returns when the last byte arrives."""
        if nbytes <= 0 or source == destination:
            return now
        duration = nbytes / self.bandwidth
        out = self._link("out", source, now)
        inb = self._link("in", destination, now)
        start = _earliest_common_gap(out, inb, now, duration)
        out.add((start, start + duration))
        inb.add((start, start + duration))
        self.bytes_moved += nbytes
        return start + duration + self.latency_s

    def start(
        self, flow: int, source: str, destination: str, nbytes: float, now: float
    ) -> list[tuple[int, float]]:
        """``Links``: a reservation never moves, so only the new transfer's end is returned."""
        return [(flow, self.transfer(source, destination, nbytes, now))]

    def finish(self, flow: int, now: float) -> list[tuple[int, float]]:
        return []

    def _link(self, direction: str, instance: str, now: float) -> SortedList:
        busy = self._busy.setdefault((direction, instance), SortedList())
        while busy and busy[0][1] <= now:  # the past is of no use to later transfers
            busy.pop(0)
        return busy


def _earliest_common_gap(a: SortedList, b: SortedList, now: float, duration: float) -> float:
    """The earliest t >= now with [t, t + duration) free in both interval lists."""
    t = now
    while True:
        moved = False
        for busy in (a, b):
            # the first interval ending after t; reservations are disjoint, so it is the only
            # one that can overlap [t, t + duration) from the left
            i = busy.bisect_left((t, float("inf")))
            for start, end in busy.islice(max(i - 1, 0)):
                if end <= t:
                    continue
                if start >= t + duration:
                    break
                t, moved = end, True  # overlaps: try after it
        if not moved:
            return t


# kvgate sim --network NAME: a new link model is one class and one line here.
NETWORK_MODELS: dict[str, Callable[[float], Links]] = {
    "fair": FairShareNetwork,
    "calendar": Network,
}
