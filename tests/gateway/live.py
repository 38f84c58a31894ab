"""Live gateways for tests: a LiveStack in a background thread so synchronous clients (the
openai SDK) can use it, and ``serving``, any ASGI app under uvicorn on a loopback port."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import aiohttp
import uvicorn

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


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """``app`` under uvicorn on an ephemeral loopback port, lifespan on; yields its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def with_stack(
    spec: StackSpec, check: Callable[[LiveStack, aiohttp.ClientSession], Awaitable[T]]
) -> T:
    """``check(stack, session)`` against a LiveStack started for it (stopped after)."""
    stack = LiveStack(spec)
    await stack.start()
    try:
        async with aiohttp.ClientSession() as s:
            return await check(stack, s)
    finally:
        await stack.stop()
