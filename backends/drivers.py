"""P/D protocol drivers: how one placed request is sent to its engines.

- vLLM (NIXL-style, sequential): the prefill leg runs with ``max_tokens: 1``, ``stream: false``
  and ``kv_transfer_params.do_remote_decode: true``; the decode leg is the original body plus
  the ``kv_transfer_params`` the prefill returned. Same ``X-Request-Id`` on both legs.
- SGLang (bootstrap, concurrent): ``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` on
  the same body, sent to prefill and decode at once; the decode's answer is returned.
- colocated: one leg.

Each driver returns an ``UpstreamResponse`` whose body is iterated without buffering; closing
it aborts every leg still open (the engines see the disconnect and free the request). Given an
``Http1Client`` (backends/http1.py: the gateway passes one) the legs use it; otherwise an
aiohttp session. A body that is forwarded unchanged is sent as the client's original bytes.
Reference: shared/reference/peer-routers.md sections 6.1, 6.2 and 9.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from backends import http1
from config.settings import Protocol as WireProtocol

_PREFILL_ONLY_DROP = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    url: str  # base URL, no trailing slash
    bootstrap_port: int | None = None


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


class UpstreamError(Exception):
    """An engine leg failed. ``status`` is None for transport errors (retryable elsewhere if
    nothing reached the client); ``instance_id`` names the leg's engine."""

    def __init__(self, instance_id: str, status: int | None, message: str, body: bytes = b""):
        super().__init__(f"{instance_id}: {message}")
        self.instance_id = instance_id
        self.status = status
        self.body = body


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
            raise UpstreamError(self.instance_id, None, f"stream broke: {exc!r}") from exc

    async def next_chunk(self) -> bytes | None:
        """What arrived since the last call; None at the end of the body."""
        try:
            chunk = await self._resp.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise UpstreamError(self.instance_id, None, f"stream broke: {exc!r}") from exc
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
            raise UpstreamError(self.instance_id, None, f"read failed: {exc!r}") from exc

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
            raise UpstreamError(self.instance_id, None, f"stream broke: {exc!r}") from exc

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
            raise UpstreamError(self.instance_id, None, f"read failed: {exc!r}") from exc


Leg = aiohttp.ClientResponse | http1.Response


class ProtocolDriver(Protocol):
    async def open(self, session: aiohttp.ClientSession, plan: ForwardPlan) -> UpstreamResponse: ...


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


async def _post(
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
            raise UpstreamError(target.instance_id, None, f"connect failed: {exc!r}") from exc
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
        raise UpstreamError(target.instance_id, None, f"connect failed: {exc!r}") from exc
    if aresp.status >= 400:
        payload = await aresp.read()
        aresp.release()
        raise UpstreamError(target.instance_id, aresp.status, f"HTTP {aresp.status}", payload)
    return aresp


async def _read_leg(leg: Leg) -> bytes:
    """The whole body of a leg; the leg is released (or closed) afterwards."""
    try:
        return await leg.read()
    finally:
        if isinstance(leg, http1.Response):
            leg.close()
        else:
            leg.release()


def _upstream(leg: Leg, instance_id: str, tasks: tuple[asyncio.Task[Any], ...] = ()):
    if isinstance(leg, http1.Response):
        return Http1UpstreamResponse(leg, instance_id, tasks)
    return UpstreamResponse(leg, instance_id, tasks)


def vllm_prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg of vLLM's NIXL protocol (toy_proxy_server.py semantics)."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_ONLY_DROP}
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class VLLMDriver:
    """Sequential NIXL-style P/D: prefill (1 token) then decode with its kv_transfer_params."""

    def __init__(self, client: http1.Http1Client | None = None) -> None:
        self.client = client

    async def open(self, session: aiohttp.ClientSession, plan: ForwardPlan) -> UpstreamResponse:
        c = self.client
        resp = await _post(session, plan.prefill, plan, vllm_prefill_body(plan.body), c)
        try:
            answer = json.loads(await _read_leg(resp))
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise UpstreamError(
                plan.prefill.instance_id, None, f"bad prefill answer: {exc!r}"
            ) from exc
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict):
            raise UpstreamError(
                plan.prefill.instance_id, 502, "prefill answer has no kv_transfer_params"
            )
        if plan.on_prefill_done is not None:
            plan.on_prefill_done()
        decode_body = dict(plan.body)
        decode_body["kv_transfer_params"] = params
        leg = await _post(session, plan.decode, plan, decode_body, c)
        return _upstream(leg, plan.decode.instance_id)


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

    async def open(self, session: aiohttp.ClientSession, plan: ForwardPlan) -> UpstreamResponse:
        room = self._rng.getrandbits(63)
        body = sglang_bodies(plan.body, plan.prefill, room)
        prefill_body = dict(body)
        prefill_body["stream"] = False  # its answer is drained, never shown to the client
        prefill_body.pop("stream_options", None)
        prefill_task = asyncio.create_task(self._drain(session, plan, prefill_body, self.client))
        try:
            resp = await _post(session, plan.decode, plan, body, self.client)
        except BaseException:
            prefill_task.cancel()  # the prefill would wait on a decode that never comes
            raise

        def prefill_finished(task: asyncio.Task[None]) -> None:
            # A failed prefill leaves the decode waiting on bootstrap: end its stream too.
            if not task.cancelled() and task.exception() is not None:
                resp.close()

        prefill_task.add_done_callback(prefill_finished)
        return _upstream(resp, plan.decode.instance_id, (prefill_task,))

    @staticmethod
    async def _drain(
        session: aiohttp.ClientSession,
        plan: ForwardPlan,
        body: dict[str, Any],
        client: http1.Http1Client | None = None,
    ) -> None:
        resp = await _post(session, plan.prefill, plan, body, client)
        await _read_leg(resp)
        if plan.on_prefill_done is not None:
            plan.on_prefill_done()


class ColocatedDriver:
    """One leg to an instance that prefills and decodes; the body goes unchanged."""

    def __init__(self, client: http1.Http1Client | None = None) -> None:
        self.client = client

    async def open(self, session: aiohttp.ClientSession, plan: ForwardPlan) -> UpstreamResponse:
        body = plan.raw_body if plan.raw_body is not None else plan.body
        leg = await _post(session, plan.decode, plan, body, self.client)
        return _upstream(leg, plan.decode.instance_id)


def driver_for(
    protocol: WireProtocol, disaggregated: bool, client: http1.Http1Client | None = None
) -> ProtocolDriver:
    if not disaggregated:
        return ColocatedDriver(client)
    if protocol is WireProtocol.SGLANG:
        return SGLangDriver(client=client)
    return VLLMDriver(client)


async def close_quietly(resp: UpstreamResponse | None) -> None:
    if resp is not None:
        with contextlib.suppress(Exception):
            resp.close()
