"""How an engine leg travels: a ``Transport`` posts a body and returns a ``Leg`` (the answer
being read), the way httpx separates a client from its transports.

Two transports: ``Http1Transport`` (the gateway's lean keep-alive client, backends/http1.py,
plain ``http://`` only: the hot path) and ``AiohttpTransport`` (an aiohttp session: https and
anything else). ``transport_for`` picks one per URL. Both keep one error contract, so the code
above them has one ``except``: a transport failure is an ``OSError`` (``TimeoutError`` when the
engine went silent), a malformed request a ``ValueError``; an HTTP error status is an answer.
"""

from __future__ import annotations

import functools
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

from backends import http1

# How long an aiohttp pool may keep an idle connection for reuse: under the 5 s keep-alive of
# uvicorn (vLLM, SGLang, kvgate) and llama-server. aiohttp keeps one 15 s and takes the oldest
# first, so a POST could go out on a connection the server is closing just then: a reset that
# aiohttp does not retry for a POST (the pd-sidecar's 502 in CI).
IDLE_KEEPALIVE_S = 4.0


class Leg(Protocol):
    """One engine answer, its headers in. Reads raise ``OSError`` when the stream breaks."""

    status: int
    content_type: str

    @property
    def complete(self) -> bool:
        """The body has been read to its end (the last chunk is out)."""
        ...

    async def read(self) -> bytes: ...

    async def next_chunk(self) -> bytes | None:
        """What arrived since the last call; None at the end of the body."""
        ...

    async def next_piece(self) -> tuple[bytes, bool] | None:
        """``next_chunk`` and whether it ends the body; None at the end."""
        ...

    def release(self) -> None:
        """Done with an answer read to its end: its connection may serve another request."""
        ...

    def close(self) -> None:
        """Abort: the engine sees the disconnect and frees the request."""
        ...


class Transport(Protocol):
    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> Leg:
        """POST ``body`` to ``base_url + path``; returns once the answer's headers are in.
        ``timeout_s`` bounds the silence between bytes of the answer, not its length."""
        ...


@functools.lru_cache(maxsize=1024)
def plain_http(url: str) -> tuple[str, int, str] | None:
    """(host, port, path prefix) of a plain-http base URL; None for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


class Http1Transport:
    """Plain ``http://`` through ``http1.Http1Client``; its ``Response`` is the ``Leg``."""

    __slots__ = ("client",)

    def __init__(self, client: http1.Http1Client) -> None:
        self.client = client

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> http1.Response:
        split = plain_http(base_url)
        if split is None:
            raise ValueError(f"{base_url}: the HTTP/1.1 transport takes plain http:// URLs")
        host, port, prefix = split
        return await self.client.post(host, port, prefix + path, body, headers, timeout_s)


def _broken(exc: aiohttp.ClientError) -> OSError:
    """aiohttp's non-OS errors (a malformed payload, a bad status line) as the contract's
    ``OSError``; its OS-level errors (refused, timeouts) already are one and pass unchanged."""
    return exc if isinstance(exc, OSError) else ConnectionError(f"{type(exc).__name__}: {exc}")


class AiohttpLeg:
    """An aiohttp answer behind the ``Leg`` contract."""

    __slots__ = ("_resp", "content_type", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    @property
    def complete(self) -> bool:
        return self._resp.content.at_eof()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except aiohttp.ClientError as exc:
            raise _broken(exc) from exc

    async def next_chunk(self) -> bytes | None:
        try:
            chunk = await self._resp.content.readany()
        except aiohttp.ClientError as exc:
            raise _broken(exc) from exc
        return chunk or None

    async def next_piece(self) -> tuple[bytes, bool] | None:
        chunk = await self.next_chunk()
        return None if chunk is None else (chunk, self.complete)

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


class AiohttpTransport:
    """Any URL aiohttp takes (https included), through one ``aiohttp.ClientSession``."""

    __slots__ = ("session",)

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def post(
        self, base_url: str, path: str, body: bytes, headers: dict[str, str], timeout_s: float
    ) -> AiohttpLeg:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=timeout_s)
        try:
            resp = await self.session.post(
                base_url + path, data=body, headers=headers, timeout=timeout
            )
        except aiohttp.ClientError as exc:
            raise _broken(exc) from exc
        return AiohttpLeg(resp)


def transport_for(
    base_url: str, session: aiohttp.ClientSession | None, client: http1.Http1Client | None
) -> Transport:
    """The lean client for plain http when there is one, else the aiohttp session."""
    if client is not None and plain_http(base_url) is not None:
        return Http1Transport(client)
    if session is None:
        raise ConnectionError(f"{base_url}: no HTTP session for this URL (gateway not started?)")
    return AiohttpTransport(session)
