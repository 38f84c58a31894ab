"""The proxy's own HTTP answers and request ids: JSON bodies, rejection and decision headers.

Kept apart from the hot path's control flow (gateway/proxy.py) so that each reads as one thing.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from typing import Any

from backends.drivers import UpstreamError
from gateway.openai import BadRequest, error_body
from gateway.relay import (
    Receive,
    ResponseStart,
    Send,
    send_stream_error,
    shutting_down_body,
    upstream_failure,
)
from routing.types import Decision, Rejection

Scope = dict[str, Any]
_JSON = (b"content-type", b"application/json")
# Request ids the gateway makes: a random per-process prefix and a counter (32 hex digits, as
# uuid4().hex, at a fraction of its cost).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def usable_request_id(given: str | None) -> bool:
    """A client's X-Request-Id is kept when it is a short token of visible ASCII: it is sent
    on to the engines as a header (an engine refuses a header line over 8 KiB, aiohttp one
    with control characters) and keys the books."""
    return (
        given is not None
        and 0 < len(given) <= 128
        and given.isascii()
        and given.isprintable()  # in ASCII: 0x20-0x7e
        and " " not in given
    )


async def read_body(receive: Receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ConnectionResetError
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body larger than {limit} bytes", status=413)
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def is_openai_error(body: bytes) -> bool:
    """Whether ``body`` is ``{"error": {"message": ...}}``."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str)


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]):
    await send({"type": "http.response.start", "status": status, "headers": [_JSON, *headers]})
    await send({"type": "http.response.body", "body": body})


def rejection_response(rej: Rejection, request_id: str) -> tuple[int, bytes, list]:
    headers = [
        (b"retry-after", str(max(1, math.ceil(rej.retry_after_s))).encode()),
        (b"x-request-id", request_id.encode()),
        (b"x-kvgate-reject-reason", rej.reason.value.encode()),
    ]
    if rej.predicted_ttft_s is not None:
        ttft_ms = f"{rej.predicted_ttft_s * 1e3:.1f}".encode()
        headers.append((b"x-kvgate-predicted-ttft-ms", ttft_ms))
    if rej.predicted_tbt_s is not None:
        headers.append((b"x-kvgate-predicted-tbt-ms", f"{rej.predicted_tbt_s * 1e3:.2f}".encode()))
    kind = "service_unavailable" if rej.no_capacity else "rate_limit_exceeded"
    return rej.http_status, error_body(rej.message, kind, code=rej.reason.value), headers


def decision_headers(d: Decision, request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"x-request-id", request_id.encode()),
        (b"x-kvgate-prefill", d.prefill.encode()),
        (b"x-kvgate-decode", d.decode.encode()),
        (b"x-kvgate-predicted-ttft-ms", f"{d.predicted_ttft_s * 1e3:.1f}".encode()),
        (b"x-kvgate-predicted-tbt-ms", f"{d.predicted_tbt_s * 1e3:.2f}".encode()),
    ]
    if d.best_effort:  # served although the predicted TTFT misses the SLO (the client knows)
        headers.append((b"x-kvgate-admission", b"best-effort"))
    return headers


async def send_upstream_error(send: Send, exc: UpstreamError, rid: str) -> None:
    """A failed engine leg's answer, when nothing has reached the client yet."""
    if exc.status is not None and exc.body:
        # An engine's own error (e.g. 400 for a bad parameter, 503 from a full decode
        # instance) is passed through as the engine said it, if it is an OpenAI error;
        # anything else (a plain-text 400 from its HTTP parser) is wrapped in one.
        body = exc.body if is_openai_error(exc.body) else None
        if body is None:
            text = exc.body[:300].decode("utf-8", "replace")
            kind = "invalid_request_error" if exc.status < 500 else "upstream_error"
            body = error_body(f"engine {exc.instance_id}: {text}", kind)
        await send_json(send, exc.status, body, [(b"x-request-id", rid.encode())])
        return
    await send_json(send, *upstream_failure(exc), [(b"x-request-id", rid.encode())])


async def end_aborted(send: Send, stream: bool, start: ResponseStart) -> None:
    """The drain cut this answer: a clean end for the client, whatever was sent."""
    if start.sent:
        await send_stream_error(send, stream, None)
        return
    with contextlib.suppress(OSError):
        await send_json(send, 503, shutting_down_body(), [(b"retry-after", b"1")])
