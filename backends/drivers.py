"""P/D protocol drivers: how one placed request is sent to its engines.

- vLLM (sequential): a one-token prefill leg, then the decode leg; what the legs carry depends
  on the pool's KV connector style (backends/vllm_pd.py).
- SGLang (bootstrap, concurrent): ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` on
  the same body, sent to prefill and decode at once; the decode's answer is returned.
- colocated: one leg.

Each driver returns an ``UpstreamResponse`` (backends/legs.py) whose body is iterated without
buffering; closing it aborts every leg still open (the engines see the disconnect and free the
request). A body that is forwarded unchanged is sent as the client's original bytes.
Reference: shared/reference/peer-routers.md sections 6.1, 6.2 and 9.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from backends import http1
from backends.legs import (
    ForwardPlan,
    Target,
    UpstreamError,
    UpstreamResponse,
    post_leg,
    read_leg,
)
from backends.vllm_pd import VLLMDriver, vllm_prefill_body
from config.settings import PDProtocol

__all__ = [
    "ColocatedDriver",
    "ForwardPlan",
    "ProtocolDriver",
    "SGLangDriver",
    "Target",
    "UpstreamError",
    "UpstreamResponse",
    "VLLMDriver",
    "driver_for",
    "sglang_bodies",
    "vllm_prefill_body",
]


class ProtocolDriver(Protocol):
    async def open(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        """Post the plan's legs and return the answer to stream back. ``session`` carries the
        legs the lean HTTP/1.1 client does not (backends/transport.py)."""
        ...


def sglang_bodies(body: Mapping[str, Any], prefill: Target, room: int) -> dict[str, Any]:
    host = urlsplit(prefill.url).hostname or "127.0.0.1"
    if ":" in host:  # IPv6 literals are bracketed, as the SGLang router does
        host = f"[{host}]"
    out = dict(body)
    out["bootstrap_host"] = host
    out["bootstrap_port"] = prefill.bootstrap_port
    out["bootstrap_room"] = room
    return out


class SGLangDriver:
    """Concurrent bootstrap P/D: the same body with bootstrap fields to both legs."""

    def __init__(
        self, rng: random.Random | None = None, client: http1.Http1Client | None = None
    ) -> None:
        self._rng = rng or random.Random()
        self.client = client

    async def open(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        room = self._rng.getrandbits(63)
        body = sglang_bodies(plan.body, plan.prefill, room)
        prefill_body = dict(body)
        prefill_body["stream"] = False  # its answer is drained, never shown to the client
        prefill_body.pop("stream_options", None)
        prefill_task = asyncio.create_task(self._drain(session, plan, prefill_body, self.client))
        try:
            resp = await post_leg(session, plan.decode, plan, body, self.client)
        except BaseException:
            prefill_task.cancel()  # the prefill would wait on a decode that never comes
            raise

        def prefill_finished(task: asyncio.Task[None]) -> None:
            # A failed prefill leaves the decode waiting on bootstrap: end its stream too.
            if not task.cancelled() and task.exception() is not None:
                resp.close()

        prefill_task.add_done_callback(prefill_finished)
        return UpstreamResponse(resp, plan.decode.instance_id, (prefill_task,))

    @staticmethod
    async def _drain(
        session: aiohttp.ClientSession | None,
        plan: ForwardPlan,
        body: dict[str, Any],
        client: http1.Http1Client | None = None,
    ) -> None:
        resp = await post_leg(session, plan.prefill, plan, body, client)
        await read_leg(resp)
        if plan.on_prefill_done is not None:
            plan.on_prefill_done()


class ColocatedDriver:
    """One leg to an instance that prefills and decodes; the body goes unchanged."""

    def __init__(self, client: http1.Http1Client | None = None) -> None:
        self.client = client

    async def open(
        self, session: aiohttp.ClientSession | None, plan: ForwardPlan
    ) -> UpstreamResponse:
        body = plan.raw_body if plan.raw_body is not None else plan.body
        leg = await post_leg(session, plan.decode, plan, body, self.client)
        return UpstreamResponse(leg, plan.decode.instance_id)


def driver_for(
    protocol: PDProtocol, disaggregated: bool, client: http1.Http1Client | None = None
) -> ProtocolDriver:
    if not disaggregated:
        return ColocatedDriver(client)
    if protocol is PDProtocol.SGLANG:
        return SGLangDriver(client=client)
    return VLLMDriver(client)
