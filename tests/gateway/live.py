"""Run a LiveStack in a background thread so synchronous clients (the openai SDK) can use it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from gateway.stack import LiveStack, StackSpec

T = TypeVar("T")


class ThreadedStack:
    def __init__(self, spec: StackSpec) -> None:
        self.stack = LiveStack(spec)
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


@contextmanager
def live_stack(spec: StackSpec) -> Iterator[ThreadedStack]:
    ts = ThreadedStack(spec)
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
