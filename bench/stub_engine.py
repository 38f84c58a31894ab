"""A fast OpenAI-compatible stub engine for proxy benchmarks.

Raw asyncio Protocol + httptools (+ uvloop when installed), response bytes encoded once and
cached, so the stub costs as little CPU as possible and the proxy in front of it is what gets
measured.

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: JSON, or SSE when ``"stream":
  true`` (HTTP/1.1 chunked, one ``data: {...}`` event per token, each its own ``write()``,
  then ``data: [DONE]``). The token count is ``max_tokens`` / ``max_completion_tokens``
  (fallback ``--tokens``); ``stream_options.include_usage`` adds a usage event.
- ``--delay-ms D`` sleeps D ms before every token after the first (the request field
  ``stub_delay_ms`` overrides it); ``--first-delay-ms`` before the first token (prefill).
- ``GET /health``, ``/v1/models``, ``/metrics`` (a few ``vllm:`` gauges); every other path is a
  404, including ``/get_model_info`` and ``/get_server_info``: a ``model_path`` there makes
  sglang-router try to download a tokenizer.

Run: ``python -m bench.stub_engine --port 18001 [--delay-ms 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import httptools

MODEL = "stub-model"
_WORD = "tok "
_SEP = (",", ":")  # compact, as vLLM writes it
_cache: dict[tuple, bytes | tuple[bytes, ...]] = {}


def _head(status: str, ctype: bytes, length: int | None) -> bytes:
    framing = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype + b"\r\n" + framing + b"\r\n"
        b"server: kvgate-stub\r\n\r\n"
    )


def _plain(status: str, ctype: bytes, body: bytes) -> bytes:
    return _head(status, ctype, len(body)) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _usage(n: int) -> dict:
    return {"prompt_tokens": 0, "completion_tokens": n, "total_tokens": n}


def json_response(chat: bool, n: int) -> bytes:
    key = ("json", chat, n)
    if key not in _cache:
        text = _WORD * n
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
            obj = "text_completion"
        body = {
            "id": "stub-1",
            "object": obj,
            "created": 0,
            "model": MODEL,
            "choices": [choice],
            "usage": _usage(n),
        }
        _cache[key] = _plain(
            "200 OK", b"application/json", json.dumps(body, separators=_SEP).encode()
        )
    return _cache[key]  # type: ignore[return-value]


def sse_events(chat: bool, n: int, usage: bool) -> tuple[bytes, ...]:
    """Chunk-framed writes: [headers + event 0, event 1, ..., (usage), [DONE] + terminator]."""
    key = ("sse", chat, n, usage)
    if key not in _cache:
        obj = "chat.completion.chunk" if chat else "text_completion"
        events = []
        for i in range(n):
            finish = "length" if i == n - 1 else None
            if chat:
                delta = {"content": _WORD} if i else {"role": "assistant", "content": _WORD}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": _WORD, "finish_reason": finish}
            ev = {"id": "stub-1", "object": obj, "created": 0, "model": MODEL, "choices": [choice]}
            events.append(_chunk(b"data: " + json.dumps(ev, separators=_SEP).encode() + b"\n\n"))
        if usage:
            ev = {"id": "stub-1", "object": obj, "model": MODEL, "choices": [], "usage": _usage(n)}
            events.append(_chunk(b"data: " + json.dumps(ev, separators=_SEP).encode() + b"\n\n"))
        done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        head = _head("200 OK", b"text/event-stream", None)
        if events:
            events[0] = head + events[0]
            events[-1] += done  # [DONE] follows the last event at once
        else:
            events = [head + done]
        _cache[key] = tuple(events)
    return _cache[key]  # type: ignore[return-value]


def _metrics(running: int) -> bytes:
    body = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{MODEL}"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
        "# TYPE vllm:gpu_cache_usage_perc gauge\n"
        f'vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.0\n'
        "# TYPE vllm:request_success_total counter\n"
        f'vllm:request_success_total{{model_name="{MODEL}"}} 0\n'
    ).encode()
    return _plain("200 OK", b"text/plain; version=0.0.4", body)


_MODELS = _plain(
    "200 OK",
    b"application/json",
    json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
    ).encode(),
)
_HEALTH = _plain("200 OK", b"text/plain", b"")
_NOT_FOUND = _plain("404 Not Found", b"application/json", b'{"error":"not found"}')
_BAD = _plain("400 Bad Request", b"application/json", b'{"error":"bad request"}')


class Stub:
    def __init__(self, tokens: int, delay_s: float, first_delay_s: float) -> None:
        self.tokens, self.delay_s, self.first_delay_s = tokens, delay_s, first_delay_s
        self.running = 0
        self.seen: set[bytes] = set()


class StubProtocol(asyncio.Protocol):
    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.busy = False  # a paced stream is being written: hold further requests
        self.pending: list[tuple[bytes, bytes, bytes]] = []

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(_BAD)
                self.transport.close()

    def connection_lost(self, exc) -> None:
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        req = (self.parser.get_method(), self.url.split(b"?", 1)[0], b"".join(self.body))
        if self.busy:
            self.pending.append(req)
        else:
            self.handle(*req)

    def handle(self, method: bytes, path: bytes, body: bytes) -> None:
        t = self.transport
        if t is None:
            return
        if path not in self.stub.seen:
            self.stub.seen.add(path)
            print(f"stub: first {method.decode()} {path.decode()}", file=sys.stderr, flush=True)
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            try:
                req = json.loads(body)
                n = int(req.get("max_tokens") or req.get("max_completion_tokens") or 0)
            except (ValueError, TypeError, AttributeError):
                t.write(_BAD)
                return
            n = n or self.stub.tokens
            chat = path == b"/v1/chat/completions"
            delay = req.get("stub_delay_ms")
            delay_s = self.stub.delay_s if delay is None else float(delay) / 1000.0
            if not req.get("stream"):
                if delay_s or self.stub.first_delay_s:
                    self._start(self._json_later(chat, n, delay_s))
                else:
                    t.write(json_response(chat, n))
                return
            opts = req.get("stream_options") or {}
            events = sse_events(chat, n, bool(opts.get("include_usage")))
            if delay_s or self.stub.first_delay_s:
                self._start(self._paced(events, delay_s))
            else:
                for ev in events:
                    t.write(ev)
            return
        if method == b"GET" and path == b"/health":
            t.write(_HEALTH)
        elif method == b"GET" and path == b"/v1/models":
            t.write(_MODELS)
        elif method == b"GET" and path == b"/metrics":
            t.write(_metrics(self.stub.running))
        else:
            t.write(_NOT_FOUND)

    def _start(self, coro) -> None:
        self.busy = True
        self.stub.running += 1
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(self._done)

    def _done(self, _task) -> None:
        self.stub.running -= 1
        self.busy = False
        while self.pending and not self.busy:
            self.handle(*self.pending.pop(0))

    async def _json_later(self, chat: bool, n: int, delay_s: float) -> None:
        await asyncio.sleep(self.stub.first_delay_s + delay_s * max(n - 1, 0))
        if self.transport is not None:
            self.transport.write(json_response(chat, n))

    async def _paced(self, events: tuple[bytes, ...], delay_s: float) -> None:
        if self.stub.first_delay_s:
            await asyncio.sleep(self.stub.first_delay_s)
        for i, ev in enumerate(events):
            if i and delay_s:
                await asyncio.sleep(delay_s)
            if self.transport is None or self.transport.is_closing():
                return  # the client went away: stop generating
            self.transport.write(ev)


async def serve(host: str, port: int, stub: Stub) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(stub), host, port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"stub: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.stub_engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18001)
    p.add_argument("--tokens", type=int, default=16, help="output tokens without max_tokens")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay before each later token")
    p.add_argument("--first-delay-ms", type=float, default=0.0, help="delay before token 1")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    stub = Stub(args.tokens, args.delay_ms / 1000.0, args.first_delay_ms / 1000.0)
    asyncio.run(serve(args.host, args.port, stub))
    return 0


if __name__ == "__main__":
    sys.exit(main())
