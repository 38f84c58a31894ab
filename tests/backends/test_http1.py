"""The lean HTTP/1.1 client of the engine legs, against a scripted raw-socket server."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from backends.drivers import ColocatedDriver, ForwardPlan, Target, UpstreamError, VLLMDriver
from backends.http1 import Http1Client, _Conn, _Pool


class RawServer:
    """Answers each request with a scripted list of (delay_s, bytes) writes; counts
    connections and notices clients that go away mid-answer."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.script = [(0.0, _json(b'{"ok":1}'))]
        self.close_after_answer = False
        # A keep-alive timeout racing the client's next request: a connection's second request
        # is read and the connection closed without an answer.
        self.drop_second_request = False
        self.client_gone = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                served += 1
                if self.drop_second_request and served == 2:
                    break
                for delay, data in self.script:
                    if delay:  # wait, noticing a client that leaves meanwhile
                        try:
                            if await asyncio.wait_for(reader.read(1), delay) == b"":
                                self.client_gone.set()
                                return
                        except TimeoutError:
                            pass
                    writer.write(data)
                    await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_gone.set()
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def _json(body: bytes, status: bytes = b"200 OK") -> bytes:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def test_keep_alive_reuse_body_bytes_and_headers() -> None:
    async def run():
        srv = RawServer()
        port = await srv.start()
        client = Http1Client()
        bodies = []
        for i in range(3):
            resp = await client.post(
                "127.0.0.1", port, "/v1/x", b'{"i":%d}' % i, {"X-Request-Id": f"r{i}"}, 5.0
            )
            assert resp.status == 200 and resp.content_type == "application/json"
            bodies.append(await resp.read())
            resp.close()
        client.close()
        await srv.stop()
        return srv, bodies

    srv, bodies = asyncio.run(run())
    assert bodies == [b'{"ok":1}'] * 3
    assert srv.connections == 1  # one keep-alive connection for all three
    assert srv.requests[2].startswith(b"POST /v1/x HTTP/1.1\r\n")
    assert b"X-Request-Id: r2\r\n" in srv.requests[2] and srv.requests[2].endswith(b'{"i":2}')


def test_stream_chunks_arrive_as_they_are_written() -> None:
    async def run():
        srv = RawServer()
        srv.script = [
            (0.0, SSE_HEAD + _chunk(b"data: 1\n\n")),
            (0.05, _chunk(b"data: 2\n\n")),
            (0.05, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"),
        ]
        port = await srv.start()
        client = Http1Client()
        resp = await client.post("127.0.0.1", port, "/s", b"{}", {}, 5.0)
        loop = asyncio.get_running_loop()
        got = [(chunk, loop.time()) async for chunk in resp.chunks()]
        client.close()
        await srv.stop()
        return resp, got

    resp, got = asyncio.run(run())
    assert resp.content_type == "text/event-stream"
    assert b"".join(c for c, _ in got) == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert len(got) == 3 and got[2][1] - got[0][1] > 0.08  # not buffered up


def test_stale_keep_alive_connection_is_retried_once() -> None:
    async def run():
        srv = RawServer()
        srv.close_after_answer = True  # the engine drops every connection after answering
        port = await srv.start()
        client = Http1Client()
        out = []
        for _ in range(2):
            resp = await client.post("127.0.0.1", port, "/x", b"{}", {}, 5.0)
            out.append(await resp.read())
        client.close()
        await srv.stop()
        return srv, out

    srv, out = asyncio.run(run())
    assert out == [b'{"ok":1}'] * 2
    assert srv.connections == 2


def test_after_a_stale_pooled_connection_the_retry_opens_a_new_one() -> None:
    # Two idle keep-alive connections in the pool, both dropped by the engine when reused: the
    # retry must not take the second stale one ("engine closed the connection twice", seen with
    # llama-server under load) but open a new connection.
    async def run():
        srv = RawServer()
        srv.script = [(0.05, _json(b'{"ok":1}'))]
        port = await srv.start()
        client = Http1Client()
        first = await asyncio.gather(
            *(client.post("127.0.0.1", port, "/x", b"{}", {}, 5.0) for _ in range(2))
        )
        for resp in first:
            await resp.read()
            resp.close()
        srv.drop_second_request = True
        srv.script = [(0.0, _json(b'{"ok":1}'))]
        resp = await client.post("127.0.0.1", port, "/x", b"{}", {}, 5.0)
        body = await resp.read()
        client.close()
        await srv.stop()
        return srv, body

    srv, body = asyncio.run(run())
    assert body == b'{"ok":1}'
    assert srv.connections == 3  # the two pooled ones, then one new


def test_close_mid_stream_disconnects_the_engine_and_read_timeout() -> None:
    async def run():
        srv = RawServer()
        srv.script = [(0.0, SSE_HEAD + _chunk(b"data: 1\n\n")), (5.0, b"0\r\n\r\n")]
        port = await srv.start()
        client = Http1Client()
        resp = await client.post("127.0.0.1", port, "/s", b"{}", {}, 5.0)
        it = resp.chunks()
        first = await it.__anext__()
        resp.close()  # the client went away
        await asyncio.wait_for(srv.client_gone.wait(), 2)
        resp2 = await client.post("127.0.0.1", port, "/s", b"{}", {}, 0.2)
        with pytest.raises(TimeoutError):
            await resp2.read()  # nothing for 0.2 s after the first event
        client.close()
        await srv.stop()
        return first

    assert asyncio.run(run()) == b"data: 1\n\n"


def test_drivers_with_the_client_map_errors_and_forward_raw_bytes() -> None:
    async def run():
        srv = RawServer()
        srv.script = [(0.0, _json(b'{"error":{"message":"boom"}}', b"400 Bad Request"))]
        port = await srv.start()
        client = Http1Client()
        url = f"http://127.0.0.1:{port}"
        t = Target("e0", url)
        raw = b'{"prompt": "hi",  "max_tokens": 3}'
        plan = ForwardPlan("rid", "/v1/completions", json.loads(raw), t, t, raw_body=raw)
        errors = []
        gone = Target("gone", "http://127.0.0.1:9")
        cases = [
            (ColocatedDriver(client), plan),
            (VLLMDriver(client), plan),
            (ColocatedDriver(client), replace(plan, prefill=gone, decode=gone)),
        ]
        for driver, p in cases:
            try:
                await driver.open(None, p)  # type: ignore[arg-type]
            except UpstreamError as exc:
                errors.append(exc)
        client.close()
        await srv.stop()
        return srv, errors

    srv, errors = asyncio.run(run())
    assert [e.status for e in errors] == [400, 400, None]
    assert b"boom" in errors[0].body and errors[2].instance_id == "gone"
    assert srv.requests[0].endswith(b'{"prompt": "hi",  "max_tokens": 3}')  # unchanged bytes
    prefill = json.loads(srv.requests[1].split(b"\r\n\r\n", 1)[1])
    assert prefill["max_tokens"] == 1 and prefill["kv_transfer_params"]["do_remote_decode"]


def test_slow_consumer_pauses_reading_and_gets_every_byte() -> None:
    async def run():
        srv = RawServer()
        parts = [bytes([65 + i % 26]) * 64 * 1024 for i in range(16)]  # 1 MiB in 16 chunks
        srv.script = [(0.0, SSE_HEAD), *((0.0, _chunk(p)) for p in parts), (0.0, b"0\r\n\r\n")]
        port = await srv.start()
        client = Http1Client()
        resp = await client.post("127.0.0.1", port, "/s", b"{}", {}, 5.0)
        got = []
        while (chunk := await resp.next_chunk()) is not None:
            got.append(chunk)
            await asyncio.sleep(0.01)  # slower than the socket
        again = await client.post("127.0.0.1", port, "/s", b"{}", {}, 5.0)  # reused, reading
        second = await again.read()
        client.close()
        await srv.stop()
        return b"".join(parts), b"".join(got), second, srv.connections

    sent, got, second, connections = asyncio.run(run())
    assert got == sent and second == sent and connections == 1


def test_a_connection_closed_as_it_opens_fails_at_once_not_at_the_silence_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine killed right after its kernel accepted the connection: the close can reach the
    client before its coroutine resumes from the connect. The request must fail as a connection
    error (the proxy retries it elsewhere), not be written into the closed transport and wait
    out the read timeout (a 504 ``engine_silent`` under SIGKILL, 1 run in ~10 of
    tests/real/test_engine_kill.py)."""
    pool_connect = _Pool.connect

    async def slow_resume(self: _Pool, timeout_s: float) -> _Conn:
        conn = await pool_connect(self, timeout_s)
        await asyncio.sleep(0.1)  # the loop delivers the reset before the request goes out
        return conn

    monkeypatch.setattr(_Pool, "connect", slow_resume)

    async def run() -> tuple[type[BaseException], float]:
        async def close_at_once(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.transport.abort()  # RST, as a killed process's socket

        server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = Http1Client()
        t0 = asyncio.get_running_loop().time()
        try:
            with pytest.raises(OSError) as err:
                await client.post("127.0.0.1", port, "/x", b"{}", {}, 3.0)
        finally:
            client.close()
            server.close()
        return err.type, asyncio.get_running_loop().time() - t0

    kind, took = asyncio.run(run())
    assert issubclass(kind, ConnectionError) and not issubclass(kind, TimeoutError)
    assert took < 1.0  # not the 3 s read timeout
