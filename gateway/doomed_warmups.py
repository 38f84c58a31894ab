"""Sends the warm-up a doomed request's rejection carries (routing/doomed_warmup.py).

The client has its 429 at once (its Retry-After says when the warm-up should be done). Then
its prompt goes to the chosen prefill instance as the request it was, made plain: one token,
not streamed, no P/D fields, so the engine renders and caches the prompt exactly as it would
the request's own (vLLM's P/D prefill and llama.cpp serve it like any request); the answer is
dropped. Its progress reaches the Conductor's books like any request's (first token and
finished, or failed), a drain (SIGTERM) waits for it or aborts it like an answer in flight, a
llama.cpp slot is pinned for it as for any request there, and a failing engine counts against
its circuit breaker. Counted in ``kvgate_doomed_warmups{outcome}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from backends.drivers import ColocatedDriver, ForwardPlan, UpstreamError
from gateway.openai import ParsedRequest
from gateway.proxy_deps import ProxyGateway
from routing.types import Rejection

log = logging.getLogger("kvgate.warmup")


def warmup_body(body: Mapping[str, Any], slot: int | None = None) -> dict[str, Any]:
    """The client's body made a one-token, non-streamed, single-choice request."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["n"] = 1
    if slot is not None:  # llama.cpp: the slot its prefix is kept in
        out["id_slot"] = slot
    return out


class DoomedWarmups:
    """Starts each warm-up in the background and keeps it until it ends."""

    def __init__(self, gw: ProxyGateway) -> None:
        self.gw = gw
        self._driver = ColocatedDriver()  # one plain leg, through the gateway's session
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, rejection: Rejection, parsed: ParsedRequest, path: str) -> None:
        """Books the warm-up ``rejection`` carries and sends it; call after the client's 429."""
        warmup = rejection.warmup
        if warmup is None or warmup.prefill not in self.gw.targets:
            return
        info = self.gw.conductor.dispatched_warmup(rejection, parsed.info, self.gw.clock())
        if info is None:  # a client's request holds the warm-up's id
            return
        self.gw.drain.enter()  # before the task runs: a drain starting now waits for it
        task = asyncio.create_task(self._send(info.request_id, warmup.prefill, parsed, path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, wid: str, instance: str, parsed: ParsedRequest, path: str) -> None:
        gw = self.gw
        outcome = "failed"
        try:
            record = gw.conductor.requests.get(wid)
            if record is None:  # its books were closed already (the instance was removed)
                return
            slot = gw.pin_slot(wid, instance, parsed.info.block_hashes)
            target = gw.targets[instance]
            plan = ForwardPlan(
                request_id=wid,
                path=path,
                body=warmup_body(parsed.body, slot),
                prefill=target,
                decode=target,
                headers={"X-Request-Id": wid},
                timeout_s=gw.silence_timeout(record.decision, 1),
            )
            upstream = await self._driver.open(gw.session, plan)
            gw.drain.streaming(wid, upstream)
            try:
                await upstream.read()
            finally:
                upstream.close()
            now = gw.clock()
            gw.conductor.first_token(wid, now)
            gw.conductor.finished(wid, now)
            gw.legs.succeeded(instance)
            outcome = "ok"
        except UpstreamError as exc:
            if exc.status is None or exc.status >= 500:  # a 4xx is the request's fault
                gw.legs.failed(exc.instance_id, exc.kind)
            log.info("warm-up %s failed: %s", wid, exc)
        finally:
            if outcome != "ok":
                gw.conductor.failed(wid, gw.clock())
            gw.unpin_slot(wid)
            gw.drain.leave(wid)
            gw.metrics.doomed_warmups.labels(outcome).inc()
