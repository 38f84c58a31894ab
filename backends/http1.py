"""A lean HTTP/1.1 client for the engine legs: pooled keep-alive connections, httptools parsing.

The proxy's hot path forwards one request and streams the answer back chunk by chunk; a
general client (aiohttp) spends more CPU per request and per chunk than the whole rest of the
gateway (docs/proxy-bench.md). This one does only what the legs need:

- one ``transport.write`` per request (request line, headers and body together);
- keep-alive connections per ``host:port``, reused LIFO; a reused connection that dies before
  any byte of the answer (the engine closed it while idle) is retried once on a new one;
- the answer is read with ``httptools``; body bytes are handed over as they arrive, several
  reads' worth joined into one chunk when the consumer is slower than the socket; reading
  pauses when more than ``_HIGH_WATER`` bytes wait for the consumer;
- a read timeout (no byte for ``read_timeout_s``) checked by one timer per request, not per
  chunk; TCP_NODELAY on every connection;
- ``close()`` before the answer is complete closes the connection: the engine sees the
  disconnect and frees the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import cast

import httptools

_HIGH_WATER = 256 * 1024
_MAX_IDLE = 512  # idle connections kept per target


class EngineSilent(TimeoutError):
    """The connection is up but no byte came for the read timeout (not a connect timeout)."""


class _Conn(asyncio.Protocol):
    __slots__ = ("closed", "keep_alive", "parser", "pool", "resp", "transport", "used")

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.used = False  # has carried a request before (a candidate for a stale close)
        self.keep_alive = True

    # ------------------------------------------------------------ transport
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection gets a full transport (write, pause_reading, ...); under uvloop its
        # class is not an asyncio.Transport subclass, so a cast, not an isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes on an idle connection: protocol error, drop it
            self.abort()
            return
        resp.last_read = resp.loop.time()
        resp.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp.fail(ConnectionError(f"bad HTTP answer: {exc}"))
            self.abort()
            return
        if resp._buf and not resp.done:  # once per read, not per chunk of the body
            resp.fed()

    def eof_received(self) -> bool:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp, self.resp = self.resp, None
        if resp is None:  # an idle connection the engine closed
            with contextlib.suppress(ValueError):
                self.pool.idle.remove(self)
        elif not resp.done:
            if resp.headers_done and resp.until_eof:
                resp.finish()
            else:
                resp.fail(
                    ConnectionError(f"connection lost: {exc!r}" if exc else "connection closed")
                )

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        if resp is None:
            return
        lname = name.lower()
        if lname == b"content-type":
            resp.content_type = value.decode("latin-1")
        elif lname in (b"content-length", b"transfer-encoding"):
            resp.until_eof = False

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is not None:
            resp.status = self.parser.get_status_code()
            self.keep_alive = self.parser.should_keep_alive()
            resp.headers_done = True
            resp.wake()

    def on_body(self, body: bytes) -> None:  # once per HTTP chunk: SSE events come one each
        resp = self.resp
        if resp is not None:
            resp._buf.append(body)
            resp._buffered += len(body)

    def on_message_complete(self) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp.finish()
        if self.keep_alive and not self.closed:
            self.pool.release(self)
        else:
            self.abort()


class Response:
    """An answer being received: status and content type once the headers are in, then the
    body as it arrives."""

    __slots__ = (
        "_buf",
        "_buffered",
        "_exc",
        "_paused",
        "_timeout_s",
        "_timer",
        "_waiter",
        "conn",
        "content_type",
        "done",
        "got_bytes",
        "headers_done",
        "last_read",
        "loop",
        "status",
        "until_eof",
    )

    def __init__(self, conn: _Conn, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.conn = conn
        self.loop = loop
        self.status = 0
        self.content_type = "application/json"
        self.headers_done = self.done = self.got_bytes = False
        self.until_eof = True  # neither Content-Length nor chunked: the body ends at EOF
        self._buf: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timeout_s = timeout_s
        self.last_read = loop.time()
        self._timer: asyncio.TimerHandle | None = loop.call_at(
            self.last_read + timeout_s, self._check_timeout
        )

    # ------------------------------------------------------------ fed by the connection
    def wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def fed(self) -> None:
        """Body bytes were added to the buffer: wake the consumer; stop reading while too much
        waits for it."""
        if self._buffered > _HIGH_WATER and not self._paused and self.conn.transport is not None:
            self._paused = True
            self.conn.transport.pause_reading()
        self.wake()

    def finish(self) -> None:
        self.done = True
        self._stop_timer()
        if self._paused:  # the connection goes back to the pool: it must read again
            self._paused = False
            if self.conn.transport is not None:
                self.conn.transport.resume_reading()
        self.wake()

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self._exc = exc
            self.done = True
            self._stop_timer()
            self.wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        self._timer = None
        if self.done:
            return
        idle = self.loop.time() - self.last_read
        if self._paused:  # we stopped reading (slow consumer): not the engine's fault
            idle = 0.0
        if idle >= self._timeout_s:
            self.fail(EngineSilent(f"no data from the engine for {self._timeout_s:g} s"))
            self.conn.abort()
        else:
            self._timer = self.loop.call_later(self._timeout_s - idle, self._check_timeout)

    # ------------------------------------------------------------ consumer side
    async def _wait(self) -> None:
        w = self.loop.create_future()
        self._waiter = w
        try:
            await w
        finally:
            self._waiter = None

    async def wait_headers(self) -> None:
        while not self.headers_done:
            if self._exc is not None:
                raise self._exc
            if self.done:
                raise ConnectionError("connection closed before the answer")
            await self._wait()

    def _take(self) -> bytes:
        buf = self._buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            if self.conn.transport is not None:
                self.conn.transport.resume_reading()
        return data

    async def next_chunk(self) -> bytes | None:
        """Body bytes that arrived since the last call (joined), waiting for some if there are
        none yet; None at the end of the body."""
        piece = await self.next_piece()
        return None if piece is None else piece[0]

    async def next_piece(self) -> tuple[bytes, bool] | None:
        """``next_chunk`` and whether those bytes end the body (a relay sends the end with
        them), in one call: the relay's per-chunk step."""
        while True:
            if self._buf:
                data = self._take()
                return data, self.done and self._exc is None
            if self._exc is not None:
                raise self._exc
            if self.done:
                return None
            w = self._waiter = self.loop.create_future()  # wake() resolves and clears it
            await w

    @property
    def complete(self) -> bool:
        """The whole body arrived and has been taken (the last chunk is out)."""
        return self.done and self._exc is None and not self._buf

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (what arrived since the last step, joined)."""
        while (chunk := await self.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        parts = []
        async for chunk in self.chunks():
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with an answer read to its end (the transport ``Leg`` contract): ``close``
        keeps a complete answer's connection in the pool and aborts any other."""
        self.close()

    def close(self) -> None:
        """Done with the answer; closes the connection if the answer is not complete."""
        self._stop_timer()
        if not self.done:
            self.done = True
            self._exc = ConnectionError("closed by the gateway")
            self.conn.resp = None
            self.conn.abort()
            self.wake()  # a consumer waiting for data sees the error


class _Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[_Conn] = []

    def release(self, conn: _Conn) -> None:
        conn.used = True
        if len(self.idle) >= _MAX_IDLE:
            self.idle = [c for c in self.idle if not c.closed]
        if len(self.idle) < _MAX_IDLE:
            self.idle.append(conn)
        else:
            conn.abort()

    async def connect(self, timeout_s: float) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Conn(self), self.host, self.port), timeout_s
        )
        return conn

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.abort()


class Http1Client:
    """Keep-alive connection pools per ``host:port``."""

    def __init__(self, connect_timeout_s: float = 5.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._pools: dict[tuple[str, int], _Pool] = {}

    async def post(
        self,
        host: str,
        port: int,
        path: str,
        body: bytes,
        headers: dict[str, str],
        read_timeout_s: float,
    ) -> Response:
        """Send a POST and return once the answer's headers are in. Raises OSError
        (ConnectionError, TimeoutError) when no answer comes."""
        pool = self._pools.get((host, port))
        if pool is None:
            pool = self._pools[(host, port)] = _Pool(host, port)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        head = [f"POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            if "\n" in v or "\r" in v or "\n" in k or "\r" in k:
                raise ValueError(f"invalid header {k!r}")
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        payload = "".join(head).encode("latin-1") + body
        loop = asyncio.get_running_loop()
        fresh = False  # after a stale pooled connection: a new one, not the next idle one
        for _attempt in range(2):
            conn = None
            while pool.idle and not fresh:
                conn = pool.idle.pop()
                if not conn.closed:
                    break
                conn = None
            if conn is None:
                conn = await pool.connect(self.connect_timeout_s)
                if conn.closed:
                    # The engine took the connection and closed it before this coroutine ran
                    # again (killed right then): a write would vanish into the closed transport
                    # and the request would wait out the silence timeout for nothing.
                    raise ConnectionResetError("engine closed the connection as it opened")
            reused = conn.used
            resp = conn.resp = Response(conn, loop, read_timeout_s)
            assert conn.transport is not None
            conn.transport.write(payload)
            try:
                await resp.wait_headers()
            except ConnectionError:
                resp.close()
                if reused and not resp.got_bytes:
                    fresh = True  # a stale keep-alive connection: once more on a new one
                    continue
                raise
            except BaseException:
                resp.close()
                raise
            return resp
        raise ConnectionError("engine closed the connection twice")  # pragma: no cover

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
