"""Fire-and-forget tasks an object starts and must end at shutdown (slot-file saves, host-cache
probes): each is kept referenced until done (the loop holds only weak references), ``wait``
waits for those running, and ``cancel_all`` cancels and awaits whatever is left."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` on the running loop (a caller without one must not call this)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def wait(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, for the tasks running now; True when none is left."""
        if self._tasks and timeout_s > 0:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        return not self._tasks

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
