"""Periodic, concurrent scrape of every engine's ``/metrics`` into ``EngineLoad`` snapshots.

Freshness is part of the answer: ``latest`` returns ``None`` once a snapshot is older than
``stale_after_s``, so a hung or dead engine reads as "unknown load" rather than as the last
(possibly idle-looking) numbers it reported. A failed scrape does not erase the previous
snapshot; it simply stops refreshing it and it ages out.

Each target has an engine flavour (``InstanceSettings.engine``): ``auto`` detects it from the
metric names, ``openai`` (a bare OpenAI-compatible server, no ``/metrics``) is not scraped.
For llama.cpp the slot layout (``/slots``, else ``/props``) is read once per engine start and
merged in: it is the only place llama-server states its KV capacity. A page that is read but
gives no load signal is logged once per instance (warning) and shown in ``stats``, never
silently taken for "no load".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from backends.prometheus import EngineHint, EngineLoad, MetricsParseError, parse_metrics
from backends.slots import SlotLayout, parse_props, parse_slots
from backends.stop_wait import wait_or_stop

log = logging.getLogger(__name__)

# An instance's engine as configured (``EngineKind``): a metrics flavour, ``auto``, or
# ``openai`` (not scraped). Anything else reads as ``auto``.
_FLAVOURS: dict[str, EngineHint] = {
    "auto": "auto",
    "vllm": "vllm",
    "sglang": "sglang",
    "llamacpp": "llamacpp",
}


@dataclass(slots=True)
class ScrapeStats:
    """Per-instance counters, for the gateway's own ``/metrics`` and the admin API."""

    scrapes: int = 0
    errors: int = 0
    last_error: str | None = None
    engine: str | None = None  # the flavour the last page was read as
    understood: bool | None = None  # whether it gave any load signal (None: none read yet)
    warned: bool = False  # "not understood" was logged for this instance


class MetricsScraper:
    """Scrapes ``{base_url}{path}`` of every target; one instance per gateway process."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        targets: Mapping[str, str],
        *,
        timeout_s: float = 1.0,
        stale_after_s: float = 5.0,
        clock: Callable[[], float],
        path: str = "/metrics",
        engines: Mapping[str, str] | None = None,
    ) -> None:
        if timeout_s <= 0 or stale_after_s <= 0:
            raise ValueError("timeout_s and stale_after_s must be positive")
        self._session = session
        self._timeout_s = timeout_s
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._path = path
        self._targets: dict[str, str] = {}
        self._engines: dict[str, str] = {}
        self._latest: dict[str, EngineLoad] = {}
        self._stats: dict[str, ScrapeStats] = {}
        self._layouts: dict[str, SlotLayout] = {}  # llama.cpp slots, read once per engine start
        self.set_targets(targets, engines)

    @property
    def targets(self) -> Mapping[str, str]:
        return dict(self._targets)

    @property
    def stats(self) -> Mapping[str, ScrapeStats]:
        return self._stats

    def errors(self, instance_id: str) -> int:
        stats = self._stats.get(instance_id)
        return stats.errors if stats is not None else 0

    def set_targets(
        self, targets: Mapping[str, str], engines: Mapping[str, str] | None = None
    ) -> None:
        """Replace the target set (and, if given, their engines: missing ones are ``auto``);
        removed instances lose their snapshot and counters."""
        self._targets = {iid: url.rstrip("/") for iid, url in targets.items()}
        if engines is not None:
            self._engines = {iid: e for iid, e in engines.items() if iid in self._targets}
        for table in (self._latest, self._stats, self._layouts):
            for gone in set(table) - set(self._targets):
                del table[gone]
        for iid in self._targets:
            self._stats.setdefault(iid, ScrapeStats())

    def latest(self, instance_id: str, now_s: float) -> EngineLoad | None:
        """Most recent snapshot, or ``None`` if there is none or it is stale."""
        load = self._latest.get(instance_id)
        if load is None or now_s - load.scraped_at_s > self._stale_after_s:
            return None
        return load

    async def scrape_all(self) -> dict[str, EngineLoad | None]:
        """Scrape every target at once; a failed or slow target maps to ``None``."""
        targets = {  # snapshot: set_targets may run while we await
            iid: url for iid, url in self._targets.items() if self._engines.get(iid) != "openai"
        }
        results = await asyncio.gather(*(self._scrape_one(i, u) for i, u in targets.items()))
        return dict(zip(targets, results, strict=True))

    async def run(
        self,
        interval_s: float,
        stop: asyncio.Event,
        on_scrape: Callable[[dict[str, EngineLoad | None]], None] | None = None,
    ) -> None:
        """Scrape every ``interval_s`` (start to start) until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            started = loop.time()
            results = await self.scrape_all()
            if on_scrape is not None:
                try:
                    on_scrape(results)
                except Exception:  # a consumer bug must not stop load tracking
                    log.exception("metrics on_scrape callback failed")
            await wait_or_stop(stop, interval_s - (loop.time() - started))

    async def _scrape_one(self, instance_id: str, base_url: str) -> EngineLoad | None:
        hint = self._engines.get(instance_id, "auto")
        try:
            # asyncio.timeout bounds connect + headers + body; a target that accepts the
            # connection and never answers must not hold up the round.
            async with asyncio.timeout(self._timeout_s):
                async with self._session.get(base_url + self._path) as resp:
                    if resp.status != 200:
                        raise _ScrapeFailed(f"HTTP {resp.status}")
                    # Prometheus text is UTF-8 by spec; naming it skips charset sniffing.
                    text = await resp.text(encoding="utf-8")
                # Parsed on the loop: a /metrics page is tens of kB, well under a
                # millisecond's worth of work per target at the intervals this runs at.
                load = parse_metrics(text, instance_id, self._clock(), _flavour(hint))
                if load.engine == "llamacpp":
                    load = await self._with_layout(instance_id, base_url, load)
        except (TimeoutError, aiohttp.ClientError, _ScrapeFailed, MetricsParseError) as exc:
            self._record_error(instance_id, exc)
            return None
        stats = self._stats.get(instance_id)
        if stats is None:  # removed while the request was in flight
            return None
        stats.scrapes += 1
        stats.engine, stats.understood = load.engine, load.understood
        if not load.understood and not stats.warned:
            stats.warned = True
            log.warning(
                "instance %s: %s%s answers but no load signal was understood (read as %s, "
                "engine %s); its load reads as unknown. Set the instance's engine "
                "(vllm, sglang, llamacpp) or check the engine's metrics flags",
                instance_id,
                base_url,
                self._path,
                load.engine,
                hint,
            )
        self._latest[instance_id] = load
        return load

    async def _with_layout(self, instance_id: str, base_url: str, load: EngineLoad) -> EngineLoad:
        """``load`` plus llama.cpp's slot layout (capacity, and busy slots if metrics lack it)."""
        layout = self._layouts.get(instance_id)
        if layout is None:
            layout = await self._read_layout(base_url)
            if layout is None:
                return load
            self._layouts[instance_id] = layout
        running = load.num_running if load.num_running is not None else layout.busy
        return dataclasses.replace(
            load, slots=layout.slots, token_capacity=layout.context_tokens, num_running=running
        )

    async def _read_layout(self, base_url: str) -> SlotLayout | None:
        for path, parse in (("/slots", parse_slots), ("/props", parse_props)):
            async with self._session.get(base_url + path) as resp:
                if resp.status != 200:  # /slots is off with --no-slots; /props stays on
                    continue
                try:
                    layout = parse(json.loads(await resp.read()))
                except ValueError:
                    layout = None
            if layout is not None:
                return layout
        return None

    def _record_error(self, instance_id: str, exc: BaseException) -> None:
        stats = self._stats.get(instance_id)
        if stats is None:
            return
        stats.errors += 1
        self._layouts.pop(instance_id, None)  # a restarted engine may have a new layout
        stats.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.debug("scrape of %s failed: %s", instance_id, stats.last_error)


class _ScrapeFailed(Exception):
    """A response that arrived but cannot be used (non-200)."""


def _flavour(engine: str) -> EngineHint:
    return _FLAVOURS.get(engine, "auto")
