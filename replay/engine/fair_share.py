"""KV transfers that share each NIC direction's bandwidth max-min fairly, as NICs do.

Every transfer in flight crosses two links, its source's outbound and its destination's
inbound, each of ``bandwidth`` bytes/s. Whenever a transfer starts or ends, the rates are
reallocated by progressive filling (the max-min fair allocation: the most contended link
splits what it has left equally among its transfers not yet limited elsewhere), so a short KV
no longer waits behind a long one on the same link: both move at once, each at its share.
The price is that arrival times move: a transfer's end is known only until the next start or
end on a link it shares, and ``start``/``finish`` return every transfer whose end moved.

The calendar network (``replay/engine/network.py``) reserves each transfer's whole duration
up front, one transfer at a time per link; it stays for the live emulator, whose transfers are
timed once, and for reproducing the tables measured with it (``kvgate sim --network calendar``).
"""

from __future__ import annotations

from dataclasses import dataclass

# An end that moved by less than this is not worth a new event (float noise of reallocation).
_MOVED_S = 1e-9


@dataclass(slots=True)
class _Flow:
    links: tuple[tuple[str, str], tuple[str, str]]
    remaining: float  # bytes not yet sent
    rate: float = 0.0  # bytes/s in the current allocation
    end: float = float("inf")  # when its last byte arrives (plus the link latency)


class FairShareNetwork:
    """Links whose bandwidth is shared among the transfers crossing them (``Links``)."""

    __slots__ = ("_flows", "_t", "bandwidth", "bytes_moved", "latency_s")

    def __init__(self, bandwidth_bytes_per_s: float, latency_s: float = 0.0005) -> None:
        if bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth must be > 0")
        self.bandwidth = bandwidth_bytes_per_s
        self.latency_s = latency_s
        self.bytes_moved = 0.0
        self._flows: dict[int, _Flow] = {}
        self._t = 0.0  # when ``remaining`` was last brought up to date

    def start(
        self, flow: int, source: str, destination: str, nbytes: float, now: float
    ) -> list[tuple[int, float]]:
        """Begin a transfer; returns (flow, end) for it and every transfer it slowed."""
        if nbytes <= 0 or source == destination:
            return [(flow, now)]
        self._advance(now)
        self._flows[flow] = _Flow((("out", source), ("in", destination)), nbytes)
        self.bytes_moved += nbytes
        return self._reallocate(now)

    def finish(self, flow: int, now: float) -> list[tuple[int, float]]:
        """``flow`` arrived; returns (flow, end) for every transfer that now goes faster."""
        if self._flows.pop(flow, None) is None:
            return []
        self._advance(now)
        return self._reallocate(now)

    @property
    def in_flight(self) -> int:
        return len(self._flows)

    def _advance(self, now: float) -> None:
        dt = now - self._t
        if dt > 0:
            for f in self._flows.values():
                f.remaining = max(f.remaining - f.rate * dt, 0.0)
        self._t = max(self._t, now)

    def _reallocate(self, now: float) -> list[tuple[int, float]]:
        rates = max_min_rates({fid: f.links for fid, f in self._flows.items()}, self.bandwidth)
        moved = []
        for fid, f in self._flows.items():
            f.rate = rates[fid]
            end = now + f.remaining / f.rate + self.latency_s
            if abs(end - f.end) > _MOVED_S:
                f.end = end
                moved.append((fid, end))
        return moved


def max_min_rates(
    flows: dict[int, tuple[tuple[str, str], ...]], capacity: float
) -> dict[int, float]:
    """The max-min fair rate of each flow over links of equal ``capacity`` (progressive
    filling: repeatedly the link with the smallest equal share left fixes the rate of its
    unfixed flows, which then use up that much of their other links)."""
    left: dict[tuple[str, str], float] = {}
    users: dict[tuple[str, str], list[int]] = {}
    for fid, links in flows.items():
        for link in links:
            left[link] = capacity
            users.setdefault(link, []).append(fid)
    count = {link: len(u) for link, u in users.items()}
    rates: dict[int, float] = {}
    while len(rates) < len(flows):
        # the bottleneck: ties go to the link seen first, so the result is deterministic
        link = min((x for x in count if count[x] > 0), key=lambda x: left[x] / count[x])
        share = left[link] / count[link]
        for fid in users[link]:
            if fid in rates:
                continue
            rates[fid] = share
            for other in flows[fid]:
                left[other] = max(left[other] - share, 0.0)
                count[other] -= 1
    return rates
