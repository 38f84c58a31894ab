"""Decode queue: requests turned away on the TBT check wait for decode room, cheapest first.

Where decode binds (the 2023 LLaMA2-70B profile at 1-3x load), a request is turned away on its
TBT check when its planned decode batch is full today, while its TTFT SLO would still allow it
to wait: a decode finishes every fraction of a second somewhere in the pool. So the driver
(the proxy, the simulator) holds such a request instead of answering 429 at once, and each
finished decode admits one parked request: of the ``tries`` with the shortest prompts, the
first that now passes both checks, judged against the TTFT budget it has left. What earns the
goodput is the choice, not the wait: the room a finishing decode leaves goes to the request
that costs the least of it (every request counts the same in goodput, and a decode step costs
``a + b*B + k*K``, K the batch's context: predictors/decode.py), the packing the goodput
bound assumes. Measured in a prototype (docs/experiments.md §2.3, "A decode queue"):
shortest prompt first +1.5 to +7.2 % at conversation 2023 1-3x, first come first served
-1.7 % at 3x / 30 s.

Starvation is bounded by the deadline: a parked request waits at most ``max_wait_share`` of
its TTFT SLO (and ``max_wait_s``) before it hears its 429, which is what it would have heard
at once without the queue; every arrival is still checked first on its own, so a long prompt
that fits when it arrives is admitted then. Pure: the caller passes ``now``; the queue only
orders and ages what it holds.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from sortedcontainers import SortedList

from config.admission_settings import DecodeQueueSettings
from routing.types import RequestInfo


@dataclass(slots=True)
class Parked:
    request: RequestInfo
    arrival_s: float  # when it first asked: its TTFT counts from here
    ttft_slo_s: float
    deadline_s: float  # it stops waiting then
    seq: int  # parking order: ties between equal prompts go to the first parked

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.request.prompt_tokens, self.seq, self.request.request_id)


class DecodeQueue:
    def __init__(self, settings: DecodeQueueSettings) -> None:
        self.settings = settings
        self._entries: dict[str, Parked] = {}
        self._by_cost: SortedList[tuple[int, int, str]] = SortedList()
        self._deadlines: list[tuple[float, int, str]] = []  # a heap; removed ids stay (lazy)
        self._seq = 0
        self.parked = 0  # counters since start
        self.admitted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def park(self, req: RequestInfo, arrival_s: float, ttft_slo_s: float) -> bool:
        """Hold ``req`` until a finished decode admits it or its deadline passes; False when
        the queue is off, full, or its wait would be empty."""
        s = self.settings
        wait = min(s.max_wait_share * ttft_slo_s, s.max_wait_s)
        if not s.enabled or wait <= 0 or len(self._entries) >= s.max_parked:
            return False
        rid = req.request_id
        if rid in self._entries:
            return True
        self._seq += 1
        entry = self._entries[rid] = Parked(req, arrival_s, ttft_slo_s, arrival_s + wait, self._seq)
        self._by_cost.add(entry.key)
        heapq.heappush(self._deadlines, (arrival_s + wait, self._seq, rid))
        self.parked += 1
        return True

    def expire(self, now: float) -> list[RequestInfo]:
        """The parked requests whose wait is over, taken out of the queue."""
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid = heapq.heappop(self._deadlines)
            entry = self._remove(rid)
            if entry is not None:
                self.expired += 1
                out.append(entry.request)
        return out

    def entry(self, request_id: str) -> Parked | None:
        return self._entries.get(request_id)

    def cheapest(self) -> list[Parked]:
        """The ``tries`` parked requests with the shortest prompts, shortest first."""
        return [self._entries[rid] for _, _, rid in self._by_cost[: self.settings.tries]]

    def admit(self, request_id: str) -> Parked | None:
        entry = self._remove(request_id)
        if entry is not None:
            self.admitted += 1
        return entry

    def drop(self, request_id: str) -> Parked | None:
        """Its client stopped waiting (gone, or the driver gave up on it)."""
        return self._remove(request_id)

    def _remove(self, request_id: str) -> Parked | None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._by_cost.remove(entry.key)
        return entry
