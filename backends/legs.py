"""The engine legs of one placed request: where they go, how they are posted, and the answer
streamed back to the client.

A leg is posted through the gateway's lean ``Http1Client`` (backends/http1.py) when one is
given and the URL is plain http, else through an aiohttp session. An engine's HTTP error and a
transport failure are both an ``UpstreamError``: ``status`` tells them apart (None = transport,
which the proxy may retry elsewhere while nothing has reached the client); ``kind`` says which
transport failure it was (``Failure``), because each is handled differently.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from backends import http1
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
    """The answer being streamed back from the decode (or only) leg."""

    def __init__(
        self,
        resp: aiohttp.ClientResponse,
        instance_id: str,
        extra_tasks: tuple[asyncio.Task[Any], ...] = (),
    ) -> None:
        self._resp = resp
        self.instance_id = instance_id
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")
        self._tasks = extra_tasks

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise stream_error(self.instance_id, exc) from exc

    async def next_chunk(self) -> bytes | None:
        """What arrived since the last call; None at the end of the body."""
        try:
            chunk = await self._resp.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise stream_error(self.instance_id, exc) from exc
        return chunk or None

    async def next_piece(self) -> tuple[bytes, bool] | None:
        """``next_chunk`` and whether it ends the body; None at the end."""
        chunk = await self.next_chunk()
        return None if chunk is None else (chunk, self.complete)

    def piece_reader(self) -> Callable[[], Awaitable[tuple[bytes, bool] | None]]:
        """``next_piece`` for a relay loop, which may raise ``OSError`` for a broken stream
        as well as ``UpstreamError`` (the caller names the instance)."""
        return self.next_piece

    @property
    def complete(self) -> bool:
        """The body has been read to its end (the last chunk is out)."""
        return self._resp.content.at_eof()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise stream_error(self.instance_id, exc, "read failed") from exc

    def close(self) -> None:
        """Abort whatever is still open (client left, or the answer is complete)."""
        self._resp.close()
        for task in self._tasks:
            task.cancel()


class Http1UpstreamResponse(UpstreamResponse):
    """The same, read through the lean HTTP/1.1 client."""

    def __init__(
        self,
        resp: http1.Response,
        instance_id: str,
        extra_tasks: tuple[asyncio.Task[Any], ...] = (),
    ) -> None:
        self._resp = resp  # type: ignore[assignment]
        self.instance_id = instance_id
        self.status = resp.status
        self.content_type = resp.content_type
        self._tasks = extra_tasks

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def next_chunk(self) -> bytes | None:
        try:
            return await self._resp.next_chunk()  # type: ignore[attr-defined]
        except OSError as exc:
            raise stream_error(self.instance_id, exc) from exc

    def piece_reader(self) -> Callable[[], Awaitable[tuple[bytes, bool] | None]]:
        # The connection's own reader, one coroutine frame less per chunk.
        return self._resp.next_piece  # type: ignore[attr-defined,no-any-return]

    @property
    def complete(self) -> bool:
        return self._resp.complete  # type: ignore[attr-defined]

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except OSError as exc:
            raise stream_error(self.instance_id, exc, "read failed") from exc


Leg = aiohttp.ClientResponse | http1.Response


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[str, int, str] | None:
    """(host, port, path prefix) of a plain-http base URL; None for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def _encode(body: dict[str, Any] | bytes) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body, separators=(",", ":")).encode()


async def post_leg(
    session: aiohttp.ClientSession,
    target: Target,
    plan: ForwardPlan,
    body: dict[str, Any] | bytes,
    client: http1.Http1Client | None = None,
) -> Leg:
    split = _split(target.url) if client is not None else None
    if split is not None:
        assert client is not None
        headers = {**plan.headers, "Content-Type": "application/json"}
        try:
            resp = await client.post(
                split[0], split[1], split[2] + plan.path, _encode(body), headers, plan.timeout_s
            )
        except (OSError, ValueError) as exc:
            kind = connect_failure(exc)
            what = "engine silent" if kind is Failure.SILENT else "connect failed"
            raise UpstreamError(target.instance_id, None, f"{what}: {exc!r}", kind=kind) from exc
        if resp.status >= 400:
            try:
                payload = await resp.read()
            except OSError:
                payload = b""
            resp.close()
            raise UpstreamError(target.instance_id, resp.status, f"HTTP {resp.status}", payload)
        return resp
    try:
        aresp = await session.post(
            target.url + plan.path,
            data=_encode(body),
            headers={**plan.headers, "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=plan.timeout_s),
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        kind = connect_failure(exc)
        what = "engine silent" if kind is Failure.SILENT else "connect failed"
        raise UpstreamError(target.instance_id, None, f"{what}: {exc!r}", kind=kind) from exc
    if aresp.status >= 400:
        payload = await aresp.read()
        aresp.release()
        raise UpstreamError(target.instance_id, aresp.status, f"HTTP {aresp.status}", payload)
    return aresp


async def read_leg(leg: Leg) -> bytes:
    """The whole body of a leg; the leg is released (or closed) afterwards."""
    try:
        return await leg.read()
    finally:
        if isinstance(leg, http1.Response):
            leg.close()
        else:
            leg.release()


def upstream_of(
    leg: Leg, instance_id: str, tasks: tuple[asyncio.Task[Any], ...] = ()
) -> UpstreamResponse:
    if isinstance(leg, http1.Response):
        return Http1UpstreamResponse(leg, instance_id, tasks)
    return UpstreamResponse(leg, instance_id, tasks)
