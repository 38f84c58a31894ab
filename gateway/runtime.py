"""One running gateway: the Conductor plus everything with I/O around it.

Owns the HTTP clients (backends/http1.py: pooled keep-alive connections for the engine legs;
an aiohttp session for health checks, scrapes and replication), the protocol drivers, health
checks and circuit breakers, the metrics scraper, KV-event subscribers, the replication sink,
metrics, tracing and the learner. Settings changes from the admin API are
validated and applied here. The clock is injectable (monotonic seconds) for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from backends.drivers import ProtocolDriver, Target, driver_for
from backends.health import BreakerConfig, CircuitBreaker, HealthChecker
from backends.http1 import Http1Client
from backends.kv_events import KVEventSubscriber
from backends.scraper import MetricsScraper
from config.settings import InstanceSettings, PoolSettings, ReplicationSink, Role, Settings
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.tracing import Tracing
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.tokenizer import load_tokenizer
from routing.types import AllBlocksCleared, KVEvent, ReplicationCommand, Tier

log = logging.getLogger("kvgate.gateway")


def tune_gc() -> None:
    """For a gateway process, once its modules and app are built: the cyclic GC stops
    rescanning the ~75k objects that live as long as the process (gc.freeze) and runs its
    young collections less often. Measured (docs/proxy-bench.md): full collections of 25-55 ms
    about once a second under load, ~20 us of GC per request, fall to ~1.5 us per request."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)


class Gateway:
    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.conductor = Conductor(settings)
        self.metrics = GatewayMetrics()
        self.tracing = Tracing(settings.server)
        self.tokenizer = load_tokenizer(
            settings.routing.tokenizer_file, settings.routing.chars_per_token
        )
        self.hasher = BlockHasher(settings.routing.block_size)
        self.learner = Learner(
            self.conductor, settings.server.recent_decisions, settings.server.refit_min_samples
        )
        self.targets: dict[str, Target] = {}
        self.specs: dict[str, InstanceSettings] = {}
        self.breakers: dict[str, CircuitBreaker] = {}
        self.replications: deque[dict[str, object]] = deque(maxlen=1000)
        self.session: aiohttp.ClientSession | None = None  # health checks and scrapes
        self.client = Http1Client()  # the engine legs (pooled keep-alive connections)
        self.health: HealthChecker | None = None
        self.scraper: MetricsScraper | None = None
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._replication_tasks: set[asyncio.Task[bool]] = set()
        self._sink = None
        self._stop = asyncio.Event()
        for spec in settings.instances():
            self._register(spec)
        self.driver: ProtocolDriver = self._make_driver()

    # ------------------------------------------------------------------ instances
    def _register(self, spec: InstanceSettings) -> None:
        self.specs[spec.id] = spec
        self.targets[spec.id] = Target(spec.id, spec.url.rstrip("/"), spec.bootstrap_port)
        self.breakers[spec.id] = CircuitBreaker(BreakerConfig())
        self.metrics.healthy.labels(spec.id).set(1)

    def _make_driver(self) -> ProtocolDriver:
        specs = list(self.specs.values())
        disaggregated = any(s.role is Role.DECODE for s in specs)
        protocol = next((s.protocol for s in specs), None)
        from config.settings import Protocol as WireProtocol

        return driver_for(protocol or WireProtocol.VLLM, disaggregated, self.client)

    def _http_targets(self) -> dict[str, str]:
        return {iid: t.url for iid, t in self.targets.items()}

    def add_instance(self, spec: InstanceSettings) -> None:
        """Live add (validated by the caller): books, index, health, scrape, KV events."""
        self.conductor.add_instance(spec)
        self._register(spec)
        pools = list(self.settings.pools)
        for i, pool in enumerate(pools):
            if pool.role is spec.role:
                pools[i] = replace(pool, instances=(*pool.instances, spec))
                break
        else:
            pools.append(PoolSettings(spec.role.value, spec.role, (spec,)))
        self.settings = replace(self.settings, pools=tuple(pools))
        self.driver = self._make_driver()
        self._refresh_background_targets()
        if self.session is not None and spec.kv_events_endpoint:
            self._subscribe(spec)

    def remove_instance(self, instance_id: str) -> list[str]:
        affected = self.conductor.remove_instance(instance_id, self.clock())
        self.specs.pop(instance_id, None)
        self.targets.pop(instance_id, None)
        self.breakers.pop(instance_id, None)
        self.metrics.healthy.labels(instance_id).set(0)
        sub = self._subscribers.pop(instance_id, None)
        if sub is not None:
            sub.close()
        self.settings = replace(
            self.settings,
            pools=tuple(
                replace(p, instances=tuple(i for i in p.instances if i.id != instance_id))
                for p in self.settings.pools
            ),
        )
        self.driver = self._make_driver()
        self._refresh_background_targets()
        return affected

    def _refresh_background_targets(self) -> None:
        if self.health is not None:
            self.health.set_targets(self._http_targets())
        if self.scraper is not None:
            self.scraper.set_targets(self._http_targets())

    def apply_settings(self, settings: Settings) -> None:
        """Swap SLOs, policy, admission, replication live (already validated)."""
        self.conductor.apply_settings(settings)
        self.settings = settings

    # ------------------------------------------------------------------ health
    def on_health_change(self, instance_id: str, healthy: bool) -> None:
        if instance_id not in self.conductor.instances:
            return
        log.info("instance %s is now %s", instance_id, "healthy" if healthy else "unhealthy")
        self.conductor.set_health(instance_id, healthy)
        self.metrics.healthy.labels(instance_id).set(1 if healthy else 0)
        if healthy:
            self.breakers[instance_id] = CircuitBreaker(BreakerConfig())

    def leg_failed(self, instance_id: str) -> None:
        """A transport failure: count it; an open breaker ejects the instance until the health
        checker sees it answer again."""
        breaker = self.breakers.get(instance_id)
        self.metrics.upstream_errors.labels(instance_id).inc()
        if breaker is None:
            return
        now = self.clock()
        breaker.record_failure(now)
        if not breaker.allow(now):
            self.on_health_change(instance_id, False)
            if self.health is not None:
                self.health.mark_unhealthy(instance_id)

    def leg_succeeded(self, instance_id: str) -> None:
        breaker = self.breakers.get(instance_id)
        if breaker is not None:
            breaker.record_success(self.clock())

    # ------------------------------------------------------------------ replication
    def _make_sink(self):
        """The configured sink; None = dry run (commands are recorded, not executed)."""
        kind = self.settings.replication.sink
        if kind is ReplicationSink.DRY_RUN or self.session is None:
            return None
        if kind is ReplicationSink.ENGINE:
            from backends.engine_sink import EngineFetchSink

            kv = {
                iid: inst.predictors.profile.kv_bytes_per_token
                for iid, inst in self.conductor.instances.items()
            }
            rep = self.settings.replication
            return EngineFetchSink(
                self.session,
                _UrlView(self.targets),
                kv_bytes_per_token=kv,
                timeout_s=rep.timeout_s,
                max_retries=rep.max_retries,
            )
        from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink

        rep = self.settings.replication
        config = MooncakeStoreConfig(master_addr=rep.store_master_addr, segments=rep.store_segments)
        return MooncakeStoreSink(config, rep)

    def execute_replications(
        self, commands: tuple[ReplicationCommand, ...]
    ) -> list[asyncio.Task[bool]]:
        """Start every command in the background; returns the tasks of the pulls a request is
        waiting for (its own prefix), so the proxy can let its prefill start after them."""
        waits = []
        for cmd in commands:
            entry = {
                "command_id": cmd.command_id,
                "source": cmd.source,
                "destination": cmd.destination,
                "blocks": len(cmd.block_hashes),
                "tokens": cmd.tokens,
                "reason": cmd.reason.value,
                "request_id": cmd.request_id,
                "prefix_key": cmd.prefix_key,
                "issued_s": cmd.issued_s,
                "sink": self.settings.replication.sink.value,
                "state": "in_flight",
                "attempts": 1,
                "latency_s": None,
                "error": None,
            }
            self.replications.append(entry)
            if self._sink is None:
                entry["state"] = "recorded"
                self.metrics.replications.labels(cmd.reason.value, "recorded").inc()
                self.conductor.replication_dropped(cmd.command_id)
                continue
            task = asyncio.create_task(self._replicate(cmd, entry))
            self._replication_tasks.add(task)
            task.add_done_callback(self._replication_tasks.discard)
            if cmd.request_id is not None:
                waits.append(task)
        return waits

    async def _replicate(self, cmd: ReplicationCommand, entry: dict[str, object]) -> bool:
        result = await self._sink.execute(cmd)  # the sink retries within its own budget
        now = self.clock()
        entry.update(attempts=result.attempts, latency_s=result.latency_s, error=result.error)
        if not result.executed:
            entry["state"] = "not_executed"
            self.conductor.replication_dropped(cmd.command_id)
            return False
        # Store copies land in the shared store tier, engine pulls in the destination's GPU.
        tier = (
            Tier.STORE
            if self.settings.replication.sink is ReplicationSink.MOONCAKE_STORE
            else Tier.GPU
        )
        retry = self.conductor.replication_done(cmd.command_id, result.ok, now, tier)
        if retry is not None:  # the sink already spent the retries: release the slot
            self.conductor.replication_dropped(retry.command_id)
        state = "confirmed" if result.ok else result.outcome.value
        entry["state"] = state
        self.metrics.replications.labels(cmd.reason.value, state).inc()
        if result.ok:
            self.metrics.replicated_bytes.inc(result.bytes)
            self.metrics.replication_latency.observe(result.latency_s)
        return result.ok

    # ------------------------------------------------------------------ KV events
    def _on_kv_events(self, instance_id: str, events: list[KVEvent]) -> None:
        now = self.clock()
        for ev in events:
            self.conductor.kv_event(instance_id, ev, now)

    def _on_kv_resync(self, instance_id: str) -> None:
        # Lost events: forget what we believed the instance holds; it re-learns from new ones.
        self.conductor.kv_event(instance_id, AllBlocksCleared(), self.clock())

    def _subscribe(self, spec: InstanceSettings) -> None:
        assert spec.kv_events_endpoint is not None
        sub = KVEventSubscriber(
            spec.kv_events_endpoint, spec.id, self._on_kv_events, on_resync=self._on_kv_resync
        )
        self._subscribers[spec.id] = sub
        self._tasks.append(asyncio.create_task(sub.run(self._stop)))

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self._sink = self._make_sink()
        if hasattr(self._sink, "start"):
            await self._sink.start()
        srv = self.settings.server
        self.health = HealthChecker(
            self.session,
            self._http_targets(),
            interval_s=srv.health_interval_s,
            timeout_s=min(2.0, srv.health_interval_s),
            on_change=self.on_health_change,
            clock=self.clock,
        )
        self.scraper = MetricsScraper(
            self.session,
            self._http_targets(),
            timeout_s=1.0,
            stale_after_s=max(5.0, 5 * srv.scrape_interval_s),
            clock=self.clock,
        )
        self._tasks.append(asyncio.create_task(self.health.run(self._stop)))
        self._tasks.append(asyncio.create_task(self._scrape_loop()))
        if srv.refit_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._refit_loop()))
        for spec in self.specs.values():
            if spec.kv_events_endpoint:
                self._subscribe(spec)

    async def _scrape_loop(self) -> None:
        assert self.scraper is not None
        interval = self.settings.server.scrape_interval_s
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                await self.scraper.scrape_all()
            self._publish_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    def _publish_gauges(self) -> None:
        now = self.clock()
        for inst in self.conductor.instances.values():
            self.metrics.queue.labels(inst.id).set(inst.queue_time(now))
            self.metrics.batch.labels(inst.id).set(inst.batch)

    async def _refit_loop(self) -> None:
        interval = self.settings.server.refit_interval_s
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)
            if self._stop.is_set():
                break
            try:
                await self.learner.refit()
            except Exception:  # a failed refit keeps the old model
                log.exception("prefill model refit failed")

    async def shutdown(self) -> None:
        self._stop.set()
        for sub in self._subscribers.values():
            sub.close()
        for task in (*self._tasks, *self._replication_tasks):
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if hasattr(self._sink, "close"):
            with contextlib.suppress(Exception):
                await self._sink.close()
        if self.session is not None:
            await self.session.close()
        self.client.close()
        self.tracing.shutdown()


class _UrlView:
    """Instance id -> base URL, read live from the gateway's targets (instances come and go)."""

    def __init__(self, targets: dict[str, Target]) -> None:
        self._targets = targets

    def get(self, instance_id: str) -> str | None:
        t = self._targets.get(instance_id)
        return t.url if t is not None else None
