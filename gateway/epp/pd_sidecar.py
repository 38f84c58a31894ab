"""`kvgate pd-sidecar`: the decode side of prefill/decode disaggregation behind Envoy.

With P/D pools behind Envoy, `kvgate epp` picks both instances of a request and routes it to
the decode instance's sidecar (its ``sidecar_url``), naming the prefill engine in
``x-prefiller-host-port`` — llm-d's protocol (shared/reference/peer-routers.md §2.5), so either
this sidecar or llm-d's pd-sidecar can sit in front of a decode engine. The sidecar runs the
legs with `kvgate serve`'s own vLLM driver (backends/vllm_pd.py): a one-token prefill on the
named engine, then the decode on its own engine with the ``kv_transfer_params`` the prefill
returned (``--connector nixl``), or unchanged (``shared_storage``: the engine finds the KV in
the store). The decode's answer streams back as it comes.

Without the header (a colocated pick, or Envoy's round robin when the picker is away) the
request goes to the decode engine as it is. A prefill engine that answers 4xx answers the
client with it; one that cannot be reached or answers 5xx leaves the prompt to the decode
engine (as llm-d does), which ``x-kvgate-pd-fallback: prefill_failed`` on the answer says. A
client that leaves during the prefill aborts it; after it, the driver still delivers the
decode leg so the prefill's held blocks are freed (backends/vllm_pd.py). Every other request
(models, health, metrics) passes to the decode engine unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from backends.drivers import ColocatedDriver
from backends.http1 import Http1Client
from backends.legs import ForwardPlan, Target, UpstreamError, UpstreamResponse
from backends.transport import IDLE_KEEPALIVE_S
from backends.vllm_pd import VLLMDriver
from config.settings import KVConnector
from gateway.openai import CHAT, COMPLETIONS, error_body

log = logging.getLogger("kvgate.pd_sidecar")

# The prefill engine of a P/D pick (llm-d's name). Only the picker sets it: a client's own is
# removed (gateway/epp/protocol.py), or it could send prefills anywhere.
PREFILLER_HEADER = "x-prefiller-host-port"
FALLBACK_HEADER = b"x-kvgate-pd-fallback"
_PASSED = ("x-request-id", "traceparent", "tracestate", "authorization")
_HOST_PORT = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class PdSidecar:
    """The ASGI app in front of one decode engine (``decode_url``)."""

    def __init__(
        self,
        decode_url: str,
        connector: KVConnector = KVConnector.NIXL,
        *,
        timeout_s: float = 600.0,
        max_body_bytes: int = 64 << 20,
    ) -> None:
        self.decode = Target("decode", decode_url.rstrip("/"))
        self.connector = connector
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        # The legs go through the gateway's own client: it retries a pooled keep-alive
        # connection the engine closed while idle (uvicorn's 5 s keep-alive racing the next
        # POST, which aiohttp does not retry: a 502 "connection reset" seen in CI).
        self.client = Http1Client()
        self.pd = VLLMDriver(self.client)
        self.direct = ColocatedDriver(self.client)
        self.session: aiohttp.ClientSession | None = None  # everything else (health, models)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            if scope["method"] == "POST" and scope["path"] in (COMPLETIONS, CHAT):
                await self._completion(scope, receive, send)
            else:
                await self._pass(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(keepalive_timeout=IDLE_KEEPALIVE_S),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                self.client.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ completions
    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await _body(receive, self.max_body_bytes)
        if raw is None:
            await _error(send, 413, f"request body larger than {self.max_body_bytes} bytes")
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            await _error(send, 400, "the request body must be a JSON object")
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        prefiller = headers.get(PREFILLER_HEADER)
        if prefiller is not None and not _HOST_PORT.match(prefiller):
            await _error(send, 400, f"{PREFILLER_HEADER} must be host:port, got {prefiller!r}")
            return
        passed = {k: headers[k] for k in _PASSED if k in headers}
        passed.setdefault("x-request-id", uuid.uuid4().hex)
        plan = ForwardPlan(
            passed["x-request-id"], scope["path"], body,
            Target("prefill", f"http://{prefiller}", kv_connector=self.connector)
            if prefiller else self.decode,
            self.decode, passed, self.timeout_s, raw_body=raw,
        )  # fmt: skip
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            opening = asyncio.ensure_future(self._open(plan, prefiller is not None))
            await asyncio.wait({opening, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not opening.done():  # the client left first: the prefill is aborted
                opening.cancel()
                with contextlib.suppress(asyncio.CancelledError, UpstreamError):
                    await opening
                return
            try:
                upstream, fell_back = opening.result()
            except UpstreamError as exc:
                await _upstream_error(send, exc)
                return
            await _relay(upstream, fell_back, gone, send)
        finally:
            gone.cancel()

    async def _open(self, plan: ForwardPlan, disaggregated: bool) -> tuple[UpstreamResponse, bool]:
        if not disaggregated:
            return await self.direct.open(self.session, plan), False
        try:
            return await self.pd.open(self.session, plan), False
        except UpstreamError as exc:
            if exc.instance_id != "prefill" or (exc.status is not None and exc.status < 500):
                raise
            log.warning("prefill at %s failed (%s): decode prefills", plan.prefill.url, exc)
        return await self.direct.open(self.session, plan), True

    # ------------------------------------------------------------------ everything else
    async def _pass(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.session is not None
        raw = await _body(receive, self.max_body_bytes) or b""
        url = self.decode.url + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        skip = {"host", "content-length", "transfer-encoding", "connection"}
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() not in skip
        }
        try:
            async with self.session.request(
                scope["method"], url, data=raw, headers=headers, timeout=aiohttp.ClientTimeout(30)
            ) as resp:
                payload = await resp.read()
                kind = resp.headers.get("Content-Type", "application/octet-stream")
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            await _error(send, 502, f"decode engine unreachable: {exc!r}", "upstream_error")
            return
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", kind.encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request body; None once it grows past ``limit``."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(parts)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _relay(
    upstream: UpstreamResponse, fell_back: bool, gone: asyncio.Future[None], send: Send
) -> None:
    """The decode's answer, chunk by chunk; the leg closes (aborting it) if the client goes."""
    gone.add_done_callback(lambda f: f.cancelled() or upstream.close())
    headers = [(b"content-type", (upstream.content_type or "application/json").encode())]
    if fell_back:
        headers.append((FALLBACK_HEADER, b"prefill_failed"))
    await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
    try:
        while (chunk := await upstream.next_chunk()) is not None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:  # the stream broke (or the client left): end it
        log.info("decode stream ended early: %s", exc)
    finally:
        upstream.close()
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _upstream_error(send: Send, exc: UpstreamError) -> None:
    if exc.status is not None and exc.body:  # the engine's own error, as it sent it
        await send(
            {
                "type": "http.response.start",
                "status": exc.status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": exc.body})
        return
    status = exc.status or 502
    await _error(send, status, f"{exc.instance_id} engine: {exc}", "upstream_error")


async def _error(
    send: Send, status: int, message: str, kind: str = "invalid_request_error"
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": error_body(message, kind)})
