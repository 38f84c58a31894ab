"""Clients whose request waits in the decode queue (routing/decode_queue.py).

A request turned away on its TBT check is held here instead of answered 429 at once, while
the Conductor's queue takes it (``Conductor.park``). Each finished decode (the Conductor's
``after_finished`` hook, whichever front door finished it) admits at most one waiting request:
the Conductor picks it (``release_parked``), it is booked here at once (``dispatched``), so
the next release already sees it, and its handler goes on as if it had been placed on
arrival (a tenant over its fair share by then is turned away after all, before the
booking). A wait ends with the request's 429 when its deadline passes, or when a drain
begins. The proxy waits in one call (``wait``); the endpoint picker behind Envoy takes it in
two (``hold``, then ``settle``), so that it can ask Envoy to wait that long first
(gateway/epp/exchange.py). The clock is the gateway's (monotonic seconds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from routing.conductor import Conductor
from routing.types import Decision, Rejection, RequestInfo

log = logging.getLogger("kvgate.gateway")

Screen = Callable[[Decision, RequestInfo, float], Decision | Rejection]


class DecodeWaits:
    def __init__(self, conductor: Conductor, clock: Callable[[], float]) -> None:
        self.conductor = conductor
        self.clock = clock
        self._waiting: dict[str, _Waiting] = {}
        conductor.after_finished.append(self.decode_done)

    def __len__(self) -> int:
        return len(self._waiting)

    async def wait(
        self, rejection: Rejection, req: RequestInfo, screen: Screen | None = None
    ) -> Decision | Rejection:
        """The decision (booked) once a finished decode admits ``req``, else ``rejection``
        (the queue did not take it, or its wait ended without room). ``screen``: the
        tenants' fair-share check, run before the booking, which may still turn it away."""
        held = self.hold(rejection, req, screen)
        return rejection if held is None else await self.settle(held)

    def hold(
        self, rejection: Rejection, req: RequestInfo, screen: Screen | None = None
    ) -> Held | None:
        """``req`` waits in the decode queue (None: the queue did not take it); ``settle``
        must follow, which ends the wait however it goes."""
        rid = req.request_id
        now = self.clock()
        if rid in self._waiting or not self.conductor.park(rejection, req, now):
            return None
        parked = self.conductor.decode_queue.entry(rid)
        timeout = parked.deadline_s - now if parked is not None else 0.0
        fut: asyncio.Future[Decision | Rejection | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[rid] = _Waiting(req, fut, screen)
        return Held(rejection, rid, max(timeout, 0.0), fut)

    async def settle(self, held: Held) -> Decision | Rejection:
        """The end of ``held``'s wait: the decision (booked) a finished decode admitted it
        with, else its rejection (deadline, drain, or the caller cancelled)."""
        try:
            out = await asyncio.wait_for(held.future, held.timeout_s)
        except TimeoutError:
            out = None
        except asyncio.CancelledError:
            # Cancelled just after a release booked it: nobody will serve it, close the books.
            f = held.future
            if f.done() and not f.cancelled() and isinstance(f.result(), Decision):
                self.conductor.failed(held.request_id, self.clock())
            raise
        finally:
            self._waiting.pop(held.request_id, None)
            self.conductor.unpark(held.request_id)
        return held.rejection if out is None else out

    def decode_done(self, now: float) -> None:
        """A decode finished: end the waits that are over, admit at most one request. Runs
        inside the finishing request's ``Conductor.finished``: a failure here is logged, never
        passed on to that request."""
        try:
            self._decode_done(now)
        except Exception:
            log.exception("decode queue: releasing a waiting request failed")

    def _decode_done(self, now: float) -> None:
        for req in self.conductor.expire_parked(now):
            self._end(req.request_id, None)
        released = self.conductor.release_parked(now)
        if released is None:
            return
        req, decision = released
        waiting = self._waiting.get(req.request_id)
        if waiting is None or waiting.future.done():
            return  # its client is gone: nothing was booked
        out: Decision | Rejection = decision
        if waiting.screen is not None:
            out = waiting.screen(decision, waiting.request, now)
        if isinstance(out, Decision):
            self.conductor.dispatched(out, waiting.request, now)
        self._end(req.request_id, out)

    def end_all(self) -> None:
        """A drain began: every waiting client hears its rejection now."""
        for rid in list(self._waiting):
            self._end(rid, None)

    def _end(self, request_id: str, out: Decision | Rejection | None) -> None:
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_result(out)


@dataclass(frozen=True, slots=True)
class Held:
    """A request waiting in the decode queue: at most ``timeout_s`` from when it was held."""

    rejection: Rejection
    request_id: str
    timeout_s: float
    future: asyncio.Future[Decision | Rejection | None]


@dataclass(slots=True)
class _Waiting:
    request: RequestInfo
    future: asyncio.Future[Decision | Rejection | None]
    screen: Screen | None
