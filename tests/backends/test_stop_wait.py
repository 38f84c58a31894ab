"""backends/stop_wait.py: a loop's sleep that a stop event ends early."""

from __future__ import annotations

import asyncio

from backends.stop_wait import wait_or_stop


def test_a_full_interval_without_stop_says_go_on() -> None:
    async def run() -> tuple[bool, bool]:
        stop = asyncio.Event()
        return await wait_or_stop(stop, 0.01), await wait_or_stop(stop, -1.0)

    assert asyncio.run(run()) == (False, False)


def test_stop_wakes_the_sleeper_at_once() -> None:
    async def run() -> tuple[bool, float, bool]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, stop.set)
        t0 = loop.time()
        woke = await wait_or_stop(stop, 60.0)
        return woke, loop.time() - t0, await wait_or_stop(stop, 60.0)

    woke, waited, again = asyncio.run(run())
    assert woke and again
    assert waited < 30.0  # not the 60 s interval
