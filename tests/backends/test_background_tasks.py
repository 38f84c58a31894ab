"""backends/background_tasks.py: tasks kept until done, ended at shutdown."""

from __future__ import annotations

import asyncio

from backends.background_tasks import BackgroundTasks


def test_done_tasks_leave_and_cancel_all_ends_the_rest() -> None:
    async def run() -> tuple[int, int, bool, int]:
        tasks = BackgroundTasks()
        tasks.spawn(asyncio.sleep(0))
        slow = tasks.spawn(asyncio.sleep(60))
        started = len(tasks)
        await asyncio.sleep(0.01)
        running = len(tasks)
        await tasks.cancel_all()
        return started, running, slow.cancelled(), len(tasks)

    assert asyncio.run(run()) == (2, 1, True, 0)


def test_wait_returns_when_the_running_tasks_end_or_the_time_is_up() -> None:
    async def run() -> tuple[bool, bool, bool]:
        tasks = BackgroundTasks()
        empty = await tasks.wait(0.0)
        tasks.spawn(asyncio.sleep(0.02))
        ended = await tasks.wait(5.0)
        tasks.spawn(asyncio.sleep(60))
        timed_out = await tasks.wait(0.05)
        await tasks.cancel_all()
        return empty, ended, timed_out

    assert asyncio.run(asyncio.wait_for(run(), timeout=10)) == (True, True, False)
