"""Sleeping in a loop that a stop event ends: health checks, scrapes, refits and slot-file
rescans wait between rounds through this, and wake at once when the gateway shuts down."""

from __future__ import annotations

import asyncio
import contextlib


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` (nothing if not positive) unless ``stop`` is set first; True if
    ``stop`` is set."""
    if seconds > 0 and not stop.is_set():
        with contextlib.suppress(TimeoutError):  # the normal case: a full interval
            await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()
