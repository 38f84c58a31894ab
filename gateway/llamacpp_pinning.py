"""llama.cpp slots in the gateway: which slot a request is pinned to (``id_slot``), the slot
files loaded before it goes out and saved after (gateway/slot_files.py), and which engines are
not pinned at all because they keep a host prompt cache (gateway/host_cache_probes.py). The
book itself is the Conductor's (routing/llamacpp_slots.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from backends.legs import Target
from config.settings import RoutingSettings
from gateway.host_cache_probes import HostCacheProbes
from gateway.metrics import GatewayMetrics
from gateway.slot_files import SlotFiles
from routing.conductor import Conductor
from routing.types import Decision

log = logging.getLogger(__name__)


class SlotPinning:
    def __init__(
        self,
        routing: Callable[[], RoutingSettings],
        conductor: Conductor,
        metrics: GatewayMetrics,
        targets: Mapping[str, Target],
        session: Callable[[], aiohttp.ClientSession | None],
        clock: Callable[[], float],
    ) -> None:
        self._routing = routing
        self._conductor = conductor
        self._metrics = metrics
        self._clock = clock
        self.book = conductor.slots  # filled as the engines' /slots are read
        r = routing()
        self.files: SlotFiles | None = None
        if r.llamacpp_slot_save_path is not None and r.llamacpp_slot_affinity:
            self.files = SlotFiles(
                r.llamacpp_slot_save_path,
                r.llamacpp_slot_files_max,
                max(1, r.min_transfer_blocks),
                conductor,
                targets,
                session,
                lambda event: metrics.slot_files.labels(event).inc(),
            )
        self.probes = HostCacheProbes(
            self.book,
            lambda iid: t.url if (t := targets.get(iid)) is not None else None,
            session,
            clock,
        )

    def slots_seen(self, instance_id: str, slots: int) -> None:
        """The engine's /slots (or /props) reports ``slots`` slots."""
        r = self._routing()
        if not r.llamacpp_slot_affinity:
            return
        if r.llamacpp_host_cache_probe:
            self.probes.slots_seen(instance_id, slots)
        else:
            self.book.set_slots(instance_id, slots)

    def pin(self, request_id: str, instance_id: str, blocks: Sequence[int]) -> int | None:
        """The llama.cpp slot a request to ``instance_id`` waits for (None: the engine picks);
        the prefix it overwrites leaves the cache view at once."""
        now = self._clock()
        choice = self.book.assign(request_id, instance_id, blocks, now)
        if choice is None:
            return None
        if choice.evicted:
            self._conductor.evict(instance_id, choice.evicted, now)
            self._metrics.slot_evicted.inc(len(choice.evicted))
        if self.files is not None:
            self.files.plan_restore(
                request_id, instance_id, choice.slot, blocks, choice.matched_blocks
            )
        return choice.slot

    def unpin(self, request_id: str) -> None:
        released = self.book.release(request_id, self._clock())
        if self.files is not None:
            self.files.forget(request_id)
            if released is not None:
                self.files.slot_released(*released)

    async def restore(self, request_id: str) -> None:
        """Load the slot file planned for this pinned request before it goes out."""
        if self.files is not None:
            await self.files.restore_before(request_id)

    def cached_tokens(self, d: Decision) -> int:
        """The prompt tokens ``d`` found cached: as placed, or more where a slot file was
        loaded for it (a placement that does not price the store tier, round_robin's)."""
        if self.files is None:
            return d.cached_tokens
        restored = self.files.restored_blocks(d.request_id) * self._conductor.block_size
        return max(d.cached_tokens, min(restored, d.prompt_tokens))

    async def settled(self, scraped: asyncio.Event, budget_s: float) -> None:
        """Wait, at most ``budget_s``, until the engines' metrics were read once (``scraped``)
        and every host-cache probe has answered; the gateway takes no traffic before. A request
        placed earlier is not pinned: the engine picks its slot and the book never learns
        which prompt that slot holds, and on a per-slot fleet those first placements decide
        which prompts share slots for a long time (docs/real-engines.md, "A fleet known
        before the first request")."""
        if budget_s <= 0 or not self._routing().llamacpp_slot_affinity:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(scraped.wait(), budget_s)
        # The first scrape round sent the probes (``slots_seen``): their answers are the rest.
        if not (scraped.is_set() and await self.probes.answered(deadline - loop.time())):
            log.warning(
                "starting before the fleet is known (server.startup_wait_s = %g s): the first "
                "requests to llama.cpp engines are not pinned to slots",
                budget_s,
            )

    async def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """An earlier run's slot files into the store tier and the bound, then their rescans."""
        if self.files is None:
            return []
        await self.files.sync()
        return [asyncio.create_task(self.files.run(stop))]

    async def close(self) -> None:
        if self.files is not None:
            await self.files.close()
        await self.probes.close()
