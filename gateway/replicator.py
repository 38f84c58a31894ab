"""Runs the Conductor's replication commands on the configured sinks, and keeps their log.

One job, taken out of ``Gateway``: pick each command's sink (its destination pool's
``replication_sink`` or ``replication.sink``), run it in the background, report the outcome to
the Conductor and the metrics, and keep a bounded, typed log for ``/admin/replication``. A dry
run (the default) is the ``DryRunSink``: commands are logged as ``recorded`` and released.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from backends.drivers import Target
from backends.engine_sink import UrlLookup
from backends.prefix_tokens import PrefixTokenStore
from backends.replication import (
    DryRunSink,
    ManagedSink,
    Outcome,
    ReplicationResult,
    ReplicationSinkProtocol,
    SinkByDestination,
)
from config.settings import ReplicationSink, Settings
from gateway.metrics import GatewayMetrics
from gateway.openai import ParsedRequest
from routing.conductor import Conductor
from routing.types import Decision, ReplicationCommand, Tier

# Sinks that copy by a warm-up prefill (backends/warmup_sink.py): they need prompts' token ids.
WARMUP_SINKS = frozenset({ReplicationSink.WARMUP, ReplicationSink.CONNECTOR_STORE})


@dataclass(slots=True)
class ReplicationRecord:
    """One command as ``/admin/replication`` shows it."""

    command_id: str
    source: str
    destination: str
    blocks: int
    tokens: int
    reason: str
    request_id: str | None
    prefix_key: int
    issued_s: float
    sink: str
    state: str = "in_flight"  # -> recorded | not_executed | confirmed | failed | timeout
    attempts: int = 1
    latency_s: float | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class TargetUrls:
    """Instance id -> base URL (a ``UrlLookup``), read live from the gateway's targets
    (instances come and go)."""

    def __init__(self, targets: Mapping[str, Target]) -> None:
        self._targets = targets

    def get(self, instance_id: str) -> str | None:
        t = self._targets.get(instance_id)
        return t.url if t is not None else None


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the warm-up sink needs to know of the fleet, read live from the gateway."""

    urls: UrlLookup  # instance id -> base URL, read live
    sends_kv_events: Callable[[str], bool]
    engine_block_tokens: Callable[[str], int | None]
    pin: Callable[[str, str, Sequence[int]], int | None]  # llama.cpp slot of a warm-up
    unpin: Callable[[str], None]


class Replicator:
    def __init__(
        self,
        settings: Callable[[], Settings],  # the gateway's current settings (pools change live)
        conductor: Conductor,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        engines: EngineView,
        keep: int = 1000,
    ) -> None:
        self._settings = settings
        self.conductor = conductor
        self.metrics = metrics
        self.clock = clock
        self.engines = engines
        self.log: deque[ReplicationRecord] = deque(maxlen=keep)
        # Token ids of prompts that led to replication, for warm-up copies (no warm-up: None).
        self.prefix_tokens: PrefixTokenStore | None = None
        if self.sink_kinds() & WARMUP_SINKS:
            now = settings()
            self.prefix_tokens = PrefixTokenStore(
                now.routing.block_size, now.replication.warmup_prefix_bytes
            )
        self.sink: ReplicationSinkProtocol = DryRunSink()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._pulls: dict[str, asyncio.Task[bool]] = {}  # a request's own pulls, by command

    # ------------------------------------------------------------------ sinks
    def sink_kind(self, instance_id: str) -> ReplicationSink:
        """How copies into an instance are made: its pool's ``replication_sink`` or the default."""
        settings = self._settings()
        for pool in settings.pools:
            if pool.replication_sink is not None and any(
                i.id == instance_id for i in pool.instances
            ):
                return pool.replication_sink
        return settings.replication.sink

    def sink_kinds(self) -> set[ReplicationSink]:
        settings = self._settings()
        kinds = {p.replication_sink for p in settings.pools if p.replication_sink}
        return kinds | {settings.replication.sink}

    async def start(self, session: aiohttp.ClientSession) -> None:
        kinds = self.sink_kinds() - {ReplicationSink.DRY_RUN}
        if not kinds:
            self.sink = DryRunSink()
        elif len(kinds) == 1 and ReplicationSink.DRY_RUN not in self.sink_kinds():
            self.sink = self._build(kinds.pop(), session)
        else:
            sinks = {kind.value: self._build(kind, session) for kind in kinds}
            self.sink = SinkByDestination(sinks, lambda iid: self.sink_kind(iid).value)
        if isinstance(self.sink, ManagedSink):
            await self.sink.start()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if isinstance(self.sink, ManagedSink):
            with contextlib.suppress(Exception):
                await self.sink.close()

    def _kv_bytes_per_token(self) -> dict[str, int]:
        return {
            iid: inst.predictors.profile.kv_bytes_per_token
            for iid, inst in self.conductor.instances.items()
        }

    def _build(self, kind: ReplicationSink, session: aiohttp.ClientSession):
        rep = self._settings().replication
        if kind in WARMUP_SINKS:
            from backends.warmup_sink import ConductorCluster, WarmupSink

            assert self.prefix_tokens is not None
            cluster = ConductorCluster(
                self.conductor,
                self.clock,
                self.engines.urls.get,
                self.engines.sends_kv_events,  # its engine's KV events reach the index
                max_queue_s=rep.warmup_max_queue_s,
                engine_block_tokens=self.engines.engine_block_tokens,
            )
            return WarmupSink(
                session,
                cluster,
                self.prefix_tokens,
                kv_bytes_per_token=self._kv_bytes_per_token(),
                timeout_s=rep.timeout_s,
                max_retries=rep.max_retries,
                pin=self.engines.pin,
                unpin=self.engines.unpin,
                publish_on_source=kind is ReplicationSink.CONNECTOR_STORE,
            )
        if kind is ReplicationSink.ENGINE:
            from backends.engine_sink import EngineFetchSink

            return EngineFetchSink(
                session,
                self.engines.urls,
                kv_bytes_per_token=self._kv_bytes_per_token(),
                timeout_s=rep.timeout_s,
                max_retries=rep.max_retries,
            )
        from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink

        config = MooncakeStoreConfig(master_addr=rep.store_master_addr, segments=rep.store_segments)
        return MooncakeStoreSink(config, rep)

    # ------------------------------------------------------------------ commands
    def remember_prompt(self, path: str, parsed: ParsedRequest) -> None:
        """A request whose decision carries replication commands: keep its prompt's token ids,
        which a warm-up copy of its prefix sends (commands name blocks, not tokens)."""
        if self.prefix_tokens is not None and parsed.tokens is not None:
            self.prefix_tokens.remember_request(
                path, parsed.body, parsed.info.block_hashes, parsed.tokens, parsed.exact
            )

    def execute(self, commands: Sequence[ReplicationCommand]) -> list[asyncio.Task[bool]]:
        """Start every command in the background; returns the tasks of the pulls a request is
        waiting for (its own prefix), so the proxy can let its prefill start after them."""
        waits = []
        for cmd in commands:
            record = ReplicationRecord(
                cmd.command_id,
                cmd.source,
                cmd.destination,
                len(cmd.block_hashes),
                cmd.tokens,
                cmd.reason.value,
                cmd.request_id,
                cmd.prefix_key,
                cmd.issued_s,
                self.sink_kind(cmd.destination).value,
            )
            self.log.append(record)
            if isinstance(self.sink, DryRunSink) or record.sink == ReplicationSink.DRY_RUN.value:
                record.state = "recorded"
                self.metrics.replications.labels(cmd.reason.value, "recorded").inc()
                self.conductor.replication_dropped(cmd.command_id)
                continue
            task = asyncio.create_task(self._run(cmd, record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if cmd.request_id is not None:
                waits.append(task)
                self._pulls[cmd.command_id] = task
                task.add_done_callback(lambda _, cid=cmd.command_id: self._pulls.pop(cid, None))
        return waits

    async def before_prefill(self, path: str, parsed: ParsedRequest, d: Decision) -> None:
        """Start the decision's copies; return once the pulls its prefill reuses have landed
        (its own, and other requests' still on the wire that carry blocks it was predicted to
        reuse: ``Decision.waits_for``), or after ``replication.timeout_s``. A pull that failed
        only means the prefill computes that prefix: the request goes on."""
        if d.replications:  # a warm-up copy sends this prompt's prefix tokens
            self.remember_prompt(path, parsed)
        pulls = self.execute(d.replications) + self.running(d.waits_for)
        if pulls:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.shield(asyncio.gather(*pulls, return_exceptions=True)),
                    self._settings().replication.timeout_s,
                )

    def running(self, command_ids: Sequence[str]) -> list[asyncio.Task[bool]]:
        """The pulls among ``command_ids`` still under way (``Decision.waits_for``: another
        request's pull carries prefix blocks this request was predicted to reuse)."""
        return [t for cid in command_ids if (t := self._pulls.get(cid)) is not None]

    async def _run(self, cmd: ReplicationCommand, record: ReplicationRecord) -> bool:
        try:
            result = await self.sink.execute(cmd)  # the sink retries within its own budget
        except Exception as exc:  # a sink bug or an I/O error it let through: a failed copy
            result = ReplicationResult(cmd.command_id, Outcome.FAILED, error=repr(exc))
        now = self.clock()
        record.attempts, record.latency_s = result.attempts, result.latency_s
        record.error = result.error
        if not result.executed:
            record.state = "not_executed"
            self.conductor.replication_dropped(cmd.command_id)
            return False
        # Store copies land in the shared store tier, engine pulls in the destination's GPU.
        store = self.sink_kind(cmd.destination) is ReplicationSink.MOONCAKE_STORE
        retry = self.conductor.replication_done(
            cmd.command_id, result.ok, now, Tier.STORE if store else Tier.GPU
        )
        if retry is not None:  # the sink already spent the retries: release the slot
            self.conductor.replication_dropped(retry.command_id)
        record.state = "confirmed" if result.ok else result.outcome.value
        self.metrics.replications.labels(cmd.reason.value, record.state).inc()
        if result.ok:
            self.metrics.replicated_bytes.inc(result.bytes)
            self.metrics.replication_latency.observe(result.latency_s)
        return result.ok
