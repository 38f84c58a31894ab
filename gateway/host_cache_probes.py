"""Which llama-servers keep a host prompt cache: each is asked once, before kvgate pins requests
to its slots (backends/llamacpp_host_cache.py says why and how).

An engine with one is never pinned (``SlotBook.host_cached``): its slots are not its prefix
cache, and a pinned request bypasses the host cache. Until the answer comes (~0.1 s on an
idle engine; the gateway opens its port only after it, ``server.startup_wait_s``), the engine
picks its own slots; a probe that cannot tell (the engine refused or timed out) is
retried after ``RETRY_S``, at most ``MAX_TRIES`` times in all (then: none assumed).
``routing.llamacpp_host_cache_probe = false`` skips the probe and
assumes none (``--cache-ram 0`` everywhere, the recipe docs/real-engines.md measured).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from backends.background_tasks import BackgroundTasks
from backends.llamacpp_host_cache import has_host_prompt_cache
from routing.llamacpp_slots import SlotBook

log = logging.getLogger(__name__)

RETRY_S = 30.0
# After this many probes that could not tell (a context too small for the probe's prompts, an
# engine that refuses /completion), assume no host cache: pin, as before the probe existed.
MAX_TRIES = 3


class HostCacheProbes:
    def __init__(
        self,
        slot_book: SlotBook,
        urls: Callable[[str], str | None],
        session: Callable[[], aiohttp.ClientSession | None],
        clock: Callable[[], float],
    ) -> None:
        self._book = slot_book
        self._urls = urls
        self._session = session
        self._clock = clock
        self.answers: dict[str, bool] = {}  # instance -> keeps a host prompt cache
        self._retry_at: dict[str, float] = {}  # instances being probed or to probe again
        self._tries: dict[str, int] = {}
        self._tasks = BackgroundTasks()

    async def answered(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, for the probes sent so far; True when all answered."""
        return await self._tasks.wait(timeout_s)

    def slots_seen(self, instance_id: str, slots: int) -> None:
        """The engine reports ``slots`` slots: book them once it is known to keep no host
        prompt cache (probing it first if nobody asked yet)."""
        answer = self.answers.get(instance_id)
        if answer is False:
            self._book.set_slots(instance_id, slots)
            return
        if answer is True or self._retry_at.get(instance_id, 0.0) > self._clock():
            return
        url, session = self._urls(instance_id), self._session()
        if url is None or session is None:
            return
        self._retry_at[instance_id] = float("inf")  # one probe at a time
        self._tasks.spawn(self._probe(instance_id, slots, url, session))

    async def _probe(
        self, instance_id: str, slots: int, url: str, session: aiohttp.ClientSession
    ) -> None:
        answer = await has_host_prompt_cache(session, url, slots)
        if answer is None:
            tries = self._tries[instance_id] = self._tries.get(instance_id, 0) + 1
            if tries < MAX_TRIES:
                log.warning(
                    "llama.cpp instance %s: could not tell whether it keeps a host prompt "
                    "cache; asking again in %g s (its slots are not pinned meanwhile)",
                    instance_id,
                    RETRY_S,
                )
                self._retry_at[instance_id] = self._clock() + RETRY_S
                return
            log.warning(
                "llama.cpp instance %s: %d probes could not tell whether it keeps a host "
                "prompt cache; assuming it does not (pinning its slots). Set "
                "routing.llamacpp_slot_affinity = false if it runs with --cache-ram",
                instance_id,
                tries,
            )
            answer = False
        self.answers[instance_id] = answer
        self._retry_at.pop(instance_id, None)
        if answer:
            self._book.host_cached.add(instance_id)
            log.info(
                "llama.cpp instance %s keeps a host prompt cache (--cache-ram): kvgate lets it "
                "pick its slots (no pinning, no slot-eviction charge)",
                instance_id,
            )
        else:
            self._book.set_slots(instance_id, slots)

    async def close(self) -> None:
        await self._tasks.cancel_all()
