"""Relaying an engine's answer to the client: the streamed path, chunk by chunk, and its books.

Each chunk is sent on as it arrives, never buffered; the books (first token, tokens, time
between chunks) are kept after the send and in batches, so the per-chunk cost stays close to
the bare relay's (docs/proxy-bench.md). The response's status and headers go out with the
first bytes of the answer, not before: an engine that takes a request and then sends nothing
still lets the client get a plain 504 instead of a stream that never starts. Also: noticing a
client that left, the pieces of an answer the proxy reads without parsing it, and the errors
that end an answer cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from typing import Any

from backends.drivers import UpstreamError, UpstreamResponse
from backends.legs import Failure, stream_error
from gateway.learning import DecisionRecord
from gateway.metrics import GatewayMetrics
from gateway.openai import error_body
from routing.conductor import Conductor
from routing.prompt import TOKEN_EVENT, TOKEN_EVENT_SPACED

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
_TOKEN_FLUSH = 16  # report streamed tokens to the books in batches
_GAP_FLUSH = 256  # add time-between-chunks samples to the histogram in batches
_WATCH_AFTER_S = 0.05  # answers shorter than this never start a disconnect watcher task
_COMPLETION_TOKENS = b'"completion_tokens"'
_OUTPUT_TOKENS = b'"output_tokens"'  # the Responses API's usage
# What an engine says it found cached: vLLM / llama.cpp usage, llama.cpp timings.
_CACHED_TOKENS = b'"cached_tokens"'
_PROMPT_TOKENS = b'"prompt_tokens"'
_INPUT_TOKENS = b'"input_tokens"'  # the Responses API's usage
_CACHE_N = b'"cache_n"'
_PROMPT_N = b'"prompt_n"'


class StreamMarks:
    """How a stream other than a completion's shows its tokens (the Responses API's: events
    before the first token, a ``*.delta`` event per token); ``relay_stream`` keeps the
    stream's first chunk in ``opening`` (where such a stream names its response)."""

    __slots__ = ("opening", "token")

    def __init__(self, token: bytes) -> None:
        self.token = token
        self.opening = b""


class ResponseStart:
    """The response's ``http.response.start``, sent once (with the answer's first bytes);
    whoever sends it sets ``sent`` (inline, not a method: this is on every request's path)."""

    __slots__ = ("message", "sent")

    def __init__(self, message: dict[str, Any]) -> None:
        self.message = message
        self.sent = False


async def relay_stream(
    upstream: UpstreamResponse,
    record: DecisionRecord,
    send: Send,
    conductor: Conductor,
    metrics: GatewayMetrics,
    clock: Callable[[], float],
    start: ResponseStart | None = None,
    marks: StreamMarks | None = None,
) -> tuple[int, bytes]:
    """Relays the SSE answer chunk by chunk as it arrives, keeping the books (first token,
    streamed tokens, time between chunks); returns the tokens it carried (the final usage's
    count where the stream has one, else its token events) and the answer's
    last two chunks (where a final usage chunk is, for ``cache_report``). ``start`` goes out
    just before the first chunk (or the end of an empty answer). Without ``marks`` (a
    completion's stream) the first chunk is the first token; with them, the first chunk
    that holds a token."""
    rid = record.request_id
    next_piece = upstream.piece_reader()
    stamps: list[float] = []  # arrival of each chunk: the TBT histogram's samples
    first = 0.0
    tokens = reported = 0
    before = last = b""
    mark, mark_spaced = (TOKEN_EVENT, TOKEN_EVENT_SPACED) if marks is None else (marks.token,) * 2
    waiting = True  # for the first token
    try:
        while True:
            try:
                piece = await next_piece()
            except OSError as exc:
                raise stream_error(upstream.instance_id, exc) from exc
            if piece is None:
                if start is not None and not start.sent:
                    start.sent = True
                    await send(start.message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                break
            now = clock()
            chunk, end = piece
            before, last = last, chunk
            if not stamps and start is not None and not start.sent:
                start.sent = True
                await send(start.message)
            # The last chunk ends the response in the same write (no separate terminator);
            # the chunk goes out first, the books after.
            await send({"type": "http.response.body", "body": chunk, "more_body": not end})
            if waiting:
                if marks is not None and not stamps:
                    marks.opening = chunk
                if marks is None or mark in chunk:
                    waiting = False
                    first = now
                    record.observed_ttft_s = conductor.first_token(rid, now)
                    if record.observed_ttft_s is not None:
                        metrics.ttft.observe(record.observed_ttft_s)
            elif len(stamps) >= _GAP_FLUSH:
                observe_gaps(metrics.tbt, stamps)
                del stamps[:-1]
            stamps.append(now)
            # count_stream_tokens, inline: this runs for every chunk
            tokens += chunk.count(mark) or chunk.count(mark_spaced)
            if tokens - reported >= _TOKEN_FLUSH:
                conductor.tokens(rid, tokens - reported, now)
                reported = tokens
            if end:
                break
    finally:
        observe_gaps(metrics.tbt, stamps)
    tail = before + last
    # The engine's own count where the stream ends with usage: an event may carry several
    # tokens (a detokenizer holds back a partial word).
    tokens = usage_tokens(tail) or tokens
    if tokens > 1:
        record.observed_tbt_s = (stamps[-1] - first) / (tokens - 1)
    return tokens, tail


class ClientWatch:
    """Ends what the request holds at an engine when the client goes away: while the legs
    open, the handler's task is cancelled (a non-streamed answer's headers come only with its
    last token, so that phase can last the whole generation); once the answer streams, its
    legs are closed. Either way the engine sees its connection drop and aborts the request.

    ASGI reports a disconnect only to ``receive()``, so this needs a task waiting on it; the
    task starts once the request has run for ``_WATCH_AFTER_S`` (most answers end sooner; a
    disconnect before then is noticed when it starts, the ASGI server remembers it).
    """

    __slots__ = ("_opening", "_owner", "_receive", "_task", "_timer", "_upstream", "disconnected")

    def __init__(self, receive: Receive) -> None:
        """Made by the handler's task, as it starts opening the legs."""
        self._receive = receive
        self._upstream: UpstreamResponse | None = None
        self._owner = asyncio.current_task()
        self._opening = True
        self._task: asyncio.Task[None] | None = None
        self.disconnected = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            _WATCH_AFTER_S, self._start
        )

    def opening(self) -> None:
        """Opening the legs (again, after a failed attempt): a disconnect cancels the open."""
        self._upstream, self._opening = None, True

    def answering(self, upstream: UpstreamResponse) -> None:
        """The legs are open: a disconnect from now on closes them."""
        self._upstream, self._opening = upstream, False

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if self._upstream is not None:
            self._upstream.close()
        elif self._opening and self._owner is not None:
            self._owner.cancel()  # the open's own cleanup closes the legs it made

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


def observe_gaps(hist: Any, stamps: list[float]) -> None:
    """``hist.observe(b - a)`` for every pair of consecutive stamps, with one locked increment
    per bucket touched and one for the sum, instead of two per value (prometheus_client has no
    batch observe; if its internals change, this falls back to observing one by one)."""
    if len(stamps) < 2:
        return
    try:
        bounds, buckets, total = hist._upper_bounds, hist._buckets, hist._sum
    except AttributeError:  # pragma: no cover - another prometheus_client layout
        for a, b in itertools.pairwise(stamps):
            hist.observe(b - a)
        return
    counts = [0] * len(bounds)
    prev = stamps[0]
    for t in itertools.islice(stamps, 1, None):
        counts[bisect_left(bounds, t - prev)] += 1  # the first bucket with gap <= bound
        prev = t
    for i, n in enumerate(counts):
        if n:
            buckets[i].inc(n)
    total.inc(stamps[-1] - stamps[0])


def _last_int(body: bytes, key: bytes) -> int | None:
    """The integer value of the last ``key`` in a JSON answer, found without parsing the whole
    answer (usage and timings follow ``choices``, and a key inside string content would be
    escaped); None if absent or not an integer."""
    i = body.rfind(key)
    if i < 0:
        return None
    j = i + len(key)
    rest = body[j : j + 32].lstrip()
    if not rest.startswith(b":"):
        return None
    rest = rest[1:].lstrip()
    n = 0
    while n < len(rest) and 48 <= rest[n] <= 57:
        n += 1
    return int(rest[:n]) if n else None


def usage_tokens(body: bytes) -> int:
    """usage.completion_tokens of a JSON answer, or the Responses API's output_tokens (0 if
    absent)."""
    return _last_int(body, _COMPLETION_TOKENS) or _last_int(body, _OUTPUT_TOKENS) or 0


def cache_report(body: bytes) -> tuple[int | None, int | None]:
    """(cached prompt tokens, prompt tokens) an engine reported in an answer or a stream's
    last chunks: ``usage.prompt_tokens_details.cached_tokens`` (the Responses API:
    ``input_tokens_details``, ``input_tokens``; vLLM with
    --enable-prompt-tokens-details, llama.cpp) or llama.cpp's ``timings.cache_n`` (the
    prompt is ``cache_n + prompt_n`` there); None where it reported nothing."""
    cached = _last_int(body, _CACHED_TOKENS)
    if cached is not None:
        prompt = _last_int(body, _PROMPT_TOKENS)
        return cached, prompt if prompt is not None else _last_int(body, _INPUT_TOKENS)
    cached = _last_int(body, _CACHE_N)
    if cached is None:
        return None, None
    computed = _last_int(body, _PROMPT_N)
    return cached, None if computed is None else cached + computed


def upstream_failure(exc: UpstreamError) -> tuple[int, bytes]:
    """Status and OpenAI-shaped body for a leg that failed before any byte reached the
    client: 504 for an engine that went silent, 502 for any other transport failure."""
    if exc.kind is Failure.SILENT:
        msg = f"engine {exc.instance_id} sent nothing for too long and was aborted"
        return 504, error_body(msg, "upstream_timeout", code="engine_silent")
    return 502, error_body(f"engine {exc.instance_id} failed: {exc}", "upstream_error")


def shutting_down_body() -> bytes:
    return error_body(
        "the gateway is shutting down; retry (another replica takes the request)",
        "service_unavailable",
        code="shutting_down",
    )


async def send_stream_error(send: Send, stream: bool, exc: UpstreamError | None) -> None:
    """The response has started: end it with an error the client can see (``exc`` None: the
    gateway cut the answer because it is shutting down)."""
    if exc is None:
        msg = shutting_down_body()
    elif exc.kind is Failure.SILENT:
        msg = error_body(
            f"engine {exc.instance_id} sent nothing for too long and was aborted",
            "upstream_timeout",
            code="engine_silent",
        )
    else:
        what = "mid-stream" if stream else "while answering"
        msg = error_body(f"engine {exc.instance_id} failed {what}", "upstream_error")
    payload = b"data: " + msg + b"\n\ndata: [DONE]\n\n" if stream else msg
    with contextlib.suppress(OSError):
        await send({"type": "http.response.body", "body": payload, "more_body": False})
