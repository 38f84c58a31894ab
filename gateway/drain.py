"""Graceful shutdown: stop taking requests, let the ones in flight finish, end the rest cleanly.

On SIGTERM (gateway/serve.py) the gateway starts draining: new completions get a 503 with
Retry-After in OpenAI's error shape (``Connection: close``, so a client's next try opens a
connection elsewhere), answers already streaming may finish until the deadline, and whatever
is left then is aborted: its engine legs are closed (the engines free the requests) and the
client gets a clean error (an SSE error event and ``[DONE]`` once a stream has started, a 503
before). Only then does the server stop. Aborted answers are not the engines' fault: no circuit
breaker counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from backends.legs import UpstreamResponse

log = logging.getLogger("kvgate.drain")


@dataclass(frozen=True, slots=True)
class DrainReport:
    """How a drain ended: answers that finished by themselves and those aborted at the end."""

    finished: int
    aborted: int
    waited_s: float


class Drain:
    """The requests in flight (from parse to the end of their answer) and the draining state.

    Requests register on entry (``enter``/``leave``) and their open answer once it streams
    (``streaming``); ``run`` drains them. The clock is injectable (monotonic seconds).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.draining = False
        self.aborting = False
        self._deadline = math.inf
        self._active = 0
        self._entered_while_draining = 0
        self._answers: dict[str, UpstreamResponse] = {}
        self.aborted: set[str] = set()  # request ids whose answers the drain cut
        # Made only while a drain waits (no Event.set/clear per request on the hot path).
        self._idle: asyncio.Future[None] | None = None
        self.on_begin: list[Callable[[], object]] = []  # run when a drain begins

    # ------------------------------------------------------------------ requests
    @property
    def active(self) -> int:
        return self._active

    def enter(self) -> None:
        self._active += 1

    def leave(self, request_id: str) -> None:
        self._active -= 1
        self._answers.pop(request_id, None)
        if self.draining:
            self.aborted.discard(request_id)
            if self._active <= 0 and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    async def _wait_idle(self, timeout_s: float) -> None:
        if self._active <= 0:
            return
        self._idle = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._idle), timeout_s)

    def streaming(self, request_id: str, upstream: UpstreamResponse) -> None:
        """The request's answer is open: the drain may have to abort it. An answer that opens
        after the deadline (its engine took long to answer) is aborted at once."""
        if self.aborting:
            self.aborted.add(request_id)
            upstream.close()
            return
        self._answers[request_id] = upstream

    def retry_after_s(self) -> int:
        """What a refused client is told: try again once this process is gone."""
        left = self._deadline - self._clock()
        return max(1, math.ceil(left)) if math.isfinite(left) else 1

    # ------------------------------------------------------------------ the drain
    def begin(self, timeout_s: float) -> bool:
        """Stop taking requests; False if a drain was already under way."""
        if self.draining:
            return False
        self.draining = True
        self._deadline = self._clock() + timeout_s
        for hook in self.on_begin:  # e.g. requests waiting for decode room hear their answer
            hook()
        return True

    def abort_all(self) -> int:
        """Close every open answer now (the relay ends each with a clean error)."""
        self.aborting = True
        answers, self._answers = self._answers, {}
        for rid, upstream in answers.items():
            self.aborted.add(rid)
            upstream.close()
        return len(answers)

    async def run(self, timeout_s: float, settle_s: float = 2.0) -> DrainReport:
        """Drain: wait up to ``timeout_s`` for the requests in flight to end, abort the rest,
        then wait up to ``settle_s`` for them to send their error and leave."""
        started = self._clock()
        self.begin(timeout_s)
        before = self._active
        await self._wait_idle(timeout_s)
        left = self._active
        aborted = 0
        if left:
            aborted = self.abort_all()
            log.warning(
                "drain deadline (%.1f s) reached: aborting %d answers (%d requests in flight)",
                timeout_s,
                aborted,
                left,
            )
            await self._wait_idle(settle_s)
            if self._active:
                log.warning("%d requests still in flight after the abort", self._active)
        return DrainReport(max(before - left, 0), left, self._clock() - started)
