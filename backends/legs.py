"""The engine legs of one placed request: where they go, how they are posted, and the answer
streamed back to the client.

A leg is posted through a transport (backends/transport.py): the gateway's lean
``Http1Client`` when one is given and the URL is plain http, else an aiohttp session. An
engine's HTTP error and a transport failure are both an ``UpstreamError``: ``status`` tells them
apart (None = transport, which the proxy may retry elsewhere while nothing has reached the
client); ``kind`` says which transport failure it was (``Failure``), because each is handled
differently.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import aiohttp

from backends import http1, json_codec
from backends.transport import Leg, transport_for
from config.settings import KVConnector


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    url: str  # base URL, no trailing slash
    bootstrap_port: int | None = None
    kv_connector: KVConnector | None = None  # vLLM P/D style; None = nixl


@dataclass(slots=True)
class ForwardPlan:
    request_id: str
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    prefill: Target
    decode: Target
    headers: dict[str, str] = field(default_factory=dict)  # X-Request-Id, traceparent, ...
    timeout_s: float = 600.0
    on_prefill_done: Callable[[], None] | None = None  # vLLM: prefill leg answered
    # Late decode binding (vLLM: the decode leg is sent after the prefill answered): asked
    # just before ``on_prefill_done``; a Target moves the decode leg there.
    rebind_decode: Callable[[], Target | None] | None = None
    raw_body: bytes | None = None  # ``body`` as the client sent it, forwarded when unchanged


class Failure(StrEnum):
    """What went wrong with a leg; the proxy and the health books act on it."""

    REFUSED = "refused"  # nothing listens on the engine's port: eject the instance at once
    CONNECT = "connect"  # no connection or no answer for another reason: retry elsewhere
    SILENT = "silent"  # the engine took the request, then sent nothing for the silence timeout
    BROKEN = "broken"  # the answer broke off part-way
    HTTP = "http"  # the engine answered with an HTTP error (``status`` says which)


class UpstreamError(Exception):
    """An engine leg failed. ``status`` is None for transport errors (retryable elsewhere if
    nothing reached the client, unless the engine went silent); ``instance_id`` names the
    leg's engine; ``kind`` which failure it was."""

    def __init__(
        self,
        instance_id: str,
        status: int | None,
        message: str,
        body: bytes = b"",
        kind: Failure | None = None,
    ):
        super().__init__(f"{instance_id}: {message}")
        self.instance_id = instance_id
        self.status = status
        self.body = body
        if kind is None:
            kind = Failure.HTTP if status is not None else Failure.CONNECT
        self.kind = kind


def connect_failure(exc: BaseException) -> Failure:
    """The kind of a failure to get an answer's headers (refused, silent or other)."""
    if isinstance(exc, ConnectionRefusedError):
        return Failure.REFUSED
    os_error = getattr(exc, "os_error", None)  # aiohttp.ClientConnectorError wraps it
    if isinstance(os_error, ConnectionRefusedError):
        return Failure.REFUSED
    if isinstance(exc, http1.EngineSilent | aiohttp.SocketTimeoutError):  # not a connect timeout
        return Failure.SILENT
    return Failure.CONNECT


def stream_failure(exc: BaseException) -> Failure:
    """The kind of a failure once the answer's headers are in: a read timeout is silence."""
    return Failure.SILENT if isinstance(exc, TimeoutError) else Failure.BROKEN


def stream_error(instance_id: str, exc: BaseException, what: str = "stream broke") -> UpstreamError:
    kind = stream_failure(exc)
    message = f"no data for the silence timeout ({exc})" if kind is Failure.SILENT else what
    return UpstreamError(instance_id, None, f"{message}: {exc!r}", kind=kind)


class UpstreamResponse:
    """The answer being streamed back from the decode (or only) leg, whichever transport
    carried it; ``extra_tasks`` (a concurrent prefill leg) are cancelled with it."""

    __slots__ = ("_leg", "_tasks", "content_type", "instance_id", "status")

    def __init__(
        self, leg: Leg, instance_id: str, extra_tasks: tuple[asyncio.Task[Any], ...] = ()
    ) -> None:
        self._leg = leg
        self.instance_id = instance_id
        self.status = leg.status
        self.content_type = leg.content_type
        self._tasks = extra_tasks

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def next_chunk(self) -> bytes | None:
        """What arrived since the last call; None at the end of the body."""
        try:
            return await self._leg.next_chunk()
        except OSError as exc:
            raise stream_error(self.instance_id, exc) from exc

    def piece_reader(self) -> Callable[[], Awaitable[tuple[bytes, bool] | None]]:
        """The leg's own ``next_piece`` for a relay loop (one coroutine frame less per chunk):
        it raises ``OSError`` for a broken stream, which the caller names the instance for."""
        return self._leg.next_piece

    @property
    def complete(self) -> bool:
        """The body has been read to its end (the last chunk is out)."""
        return self._leg.complete

    async def read(self) -> bytes:
        try:
            return await self._leg.read()
        except OSError as exc:
            raise stream_error(self.instance_id, exc, "read failed") from exc

    def close(self) -> None:
        """Abort whatever is still open (client left, or the answer is complete)."""
        self._leg.close()
        for task in self._tasks:
            task.cancel()


def _encode(body: dict[str, Any] | bytes) -> bytes:
    if isinstance(body, bytes):
        return body
    return json_codec.dumps(body)


async def post_leg(
    session: aiohttp.ClientSession | None,
    target: Target,
    plan: ForwardPlan,
    body: dict[str, Any] | bytes,
    client: http1.Http1Client | None = None,
) -> Leg:
    """Posts one leg through the transport its URL takes (``transport_for``) and returns once
    the answer's headers are in. No answer, or an HTTP error, is an ``UpstreamError``."""
    transport = transport_for(target.url, session, client)
    headers = {**plan.headers, "Content-Type": "application/json"}
    try:
        leg = await transport.post(target.url, plan.path, _encode(body), headers, plan.timeout_s)
    except (OSError, ValueError) as exc:
        kind = connect_failure(exc)
        what = "engine silent" if kind is Failure.SILENT else "connect failed"
        raise UpstreamError(target.instance_id, None, f"{what}: {exc!r}", kind=kind) from exc
    if leg.status >= 400:
        try:
            payload = await leg.read()
        except OSError:
            leg.close()
            payload = b""
        else:
            leg.release()
        raise UpstreamError(target.instance_id, leg.status, f"HTTP {leg.status}", payload)
    return leg


async def read_leg(leg: Leg) -> bytes:
    """The whole body of a leg; the leg is released afterwards (aborted if the read broke)."""
    try:
        body = await leg.read()
    except BaseException:
        leg.close()
        raise
    leg.release()
    return body
