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
from urllib.parse import urlsplit

import aiohttp

from backends.drivers import ProtocolDriver, Target, driver_for
from backends.engine_events import EngineEvent
from backends.engine_keys import EngineKeyMap
from backends.engine_models import fetch_served_models
from backends.health import BreakerConfig, CircuitBreaker, HealthChecker
from backends.http1 import Http1Client
from backends.kv_events import KVEventSubscriber
from backends.model_files import make_prompt_encoder
from backends.prefix_tokens import PrefixTokenStore
from backends.profile_file import load_measured_profiles, measured_predictors
from backends.prometheus import EngineLoad
from backends.scraper import MetricsScraper
from config.settings import InstanceSettings, PoolSettings, ReplicationSink, Role, Settings
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.models import ModelRoute, build_model_routes
from gateway.openai import ParsedRequest
from gateway.tracing import Tracing
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.types import AllBlocksCleared, ReplicationCommand, Tier

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
        # predictors.profile_file: a profile measured on the user's engine, read here (the edge).
        self.measured_profiles = load_measured_profiles(settings.predictors)
        self.conductor = Conductor(
            settings, measured_predictors(settings.predictors, self.measured_profiles)
        )
        self.metrics = GatewayMetrics()
        self.tracing = Tracing(settings.server)
        self.prompt_encoder = make_prompt_encoder(settings.routing)
        self.hasher = BlockHasher(settings.routing.block_size)
        # Per served model (config ``models``): its encoder and key space; else the one above.
        self.default_route = ModelRoute(None, self.prompt_encoder, self.hasher)
        self.model_routes, self.instance_routes = build_model_routes(settings)
        # Token ids of prompts that led to replication, for warm-up copies (no warm-up: None).
        self.prefix_tokens: PrefixTokenStore | None = None
        if ReplicationSink.WARMUP in self._sink_kinds():
            self.prefix_tokens = PrefixTokenStore(
                settings.routing.block_size, settings.replication.warmup_prefix_bytes
            )
        self.learner = Learner(
            self.conductor,
            settings.server.recent_decisions,
            settings.server.refit_min_samples,
            min_new_samples=settings.server.refit_min_new_samples,
            prior=self.measured_profiles.prior(),  # refits continue from the sweeps
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
        self.engine_keys: dict[str, EngineKeyMap] = {}  # per instance: engine hash -> own keys
        self._tasks: list[asyncio.Task[None]] = []
        self._replication_tasks: set[asyncio.Task[bool]] = set()
        self._sink = None
        self._stop = asyncio.Event()
        self._engine_models: list[str] = []
        self._engine_models_at = float("-inf")
        for spec in settings.instances():
            self._register(spec)
        self.driver: ProtocolDriver = self._make_driver()

    # ------------------------------------------------------------------ instances
    def _register(self, spec: InstanceSettings) -> None:
        self.specs[spec.id] = spec
        self.targets[spec.id] = Target(
            spec.id, spec.url.rstrip("/"), spec.bootstrap_port, spec.kv_connector
        )
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

    def _engine_kinds(self) -> dict[str, str]:
        return {iid: str(spec.engine) for iid, spec in self.specs.items()}

    def add_instance(self, spec: InstanceSettings) -> None:
        """Live add (validated by the caller): books, index, health, scrape, KV events."""
        self.conductor.add_instance(spec)
        if spec.model in self.model_routes:
            self.instance_routes[spec.id] = self.model_routes[spec.model]
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
        self.engine_keys.pop(instance_id, None)
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
            self.scraper.set_targets(self._http_targets(), self._engine_kinds())

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
    def sink_kind(self, instance_id: str) -> ReplicationSink:
        """How copies into an instance are made: its pool's ``replication_sink`` or the default."""
        for pool in self.settings.pools:
            if pool.replication_sink is not None and any(
                i.id == instance_id for i in pool.instances
            ):
                return pool.replication_sink
        return self.settings.replication.sink

    def _sink_kinds(self) -> set[ReplicationSink]:
        kinds = {p.replication_sink for p in self.settings.pools if p.replication_sink}
        return kinds | {self.settings.replication.sink}

    def _make_sink(self):
        """The configured sink (per pool: one per kind, chosen by each command's destination);
        None = dry run everywhere (commands are recorded, not executed)."""
        if self.session is None:
            return None
        kinds = self._sink_kinds() - {ReplicationSink.DRY_RUN}
        if not kinds:
            return None
        if len(kinds) == 1 and ReplicationSink.DRY_RUN not in self._sink_kinds():
            return self._build_sink(kinds.pop())
        from backends.replication import SinkByDestination

        sinks = {kind.value: self._build_sink(kind) for kind in kinds}
        return SinkByDestination(sinks, lambda iid: self.sink_kind(iid).value)

    def remember_prompt(self, path: str, parsed: ParsedRequest) -> None:
        """A request whose decision carries replication commands: keep its prompt's token ids,
        which a warm-up copy of its prefix sends (commands name blocks, not tokens)."""
        if self.prefix_tokens is not None and parsed.tokens is not None:
            self.prefix_tokens.remember_request(
                path, parsed.body, parsed.info.block_hashes, parsed.tokens, parsed.exact
            )

    def _build_sink(self, kind: ReplicationSink):
        assert self.session is not None
        if kind is ReplicationSink.WARMUP:
            from backends.warmup_sink import ConductorCluster, WarmupSink

            assert self.prefix_tokens is not None
            rep = self.settings.replication
            cluster = ConductorCluster(
                self.conductor,
                self.clock,
                _UrlView(self.targets).get,
                lambda iid: iid in self._subscribers,  # its engine's KV events reach the index
                max_queue_s=rep.warmup_max_queue_s,
                engine_block_tokens=self._engine_block_tokens,
            )
            return WarmupSink(
                self.session,
                cluster,
                self.prefix_tokens,
                kv_bytes_per_token=self._kv_bytes_per_token(),
                timeout_s=rep.timeout_s,
                max_retries=rep.max_retries,
            )
        if kind is ReplicationSink.ENGINE:
            from backends.engine_sink import EngineFetchSink

            rep = self.settings.replication
            return EngineFetchSink(
                self.session,
                _UrlView(self.targets),
                kv_bytes_per_token=self._kv_bytes_per_token(),
                timeout_s=rep.timeout_s,
                max_retries=rep.max_retries,
            )
        from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink

        rep = self.settings.replication
        config = MooncakeStoreConfig(master_addr=rep.store_master_addr, segments=rep.store_segments)
        return MooncakeStoreSink(config, rep)

    def _engine_block_tokens(self, instance_id: str) -> int | None:
        """The engine's KV block size as its /metrics state it (vLLM, SGLang); None if unknown."""
        load = self.scraper.latest(instance_id, self.clock()) if self.scraper else None
        return load.block_size if load is not None else None

    def _kv_bytes_per_token(self) -> dict[str, int]:
        return {
            iid: inst.predictors.profile.kv_bytes_per_token
            for iid, inst in self.conductor.instances.items()
        }

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
                "sink": self.sink_kind(cmd.destination).value,
                "state": "in_flight",
                "attempts": 1,
                "latency_s": None,
                "error": None,
            }
            self.replications.append(entry)
            if self._sink is None or entry["sink"] == ReplicationSink.DRY_RUN.value:
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
            if self.sink_kind(cmd.destination) is ReplicationSink.MOONCAKE_STORE
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
    def _on_kv_events(self, instance_id: str, events: list[EngineEvent]) -> None:
        keys = self.engine_keys.get(instance_id)
        if keys is None:  # removed while a batch was in flight
            return
        now = self.clock()
        for ev in keys.apply(events):  # the engine's hashes -> kvgate's own keys
            self.conductor.kv_event(instance_id, ev, now)

    def _on_kv_resync(self, instance_id: str) -> None:
        # Lost events: forget what we believed the instance holds; it re-learns from new ones.
        keys = self.engine_keys.get(instance_id)
        if keys is not None:
            keys.clear()
        self.conductor.kv_event(instance_id, AllBlocksCleared(), self.clock())

    def _subscribe(self, spec: InstanceSettings) -> None:
        assert spec.kv_events_endpoint is not None
        # Engine events are keyed into the instance's model's key space, like its requests.
        route = self.instance_routes.get(spec.id, self.default_route)
        self.engine_keys[spec.id] = EngineKeyMap(route.hasher)
        sub = KVEventSubscriber(
            spec.kv_events_endpoint,
            spec.id,
            self._on_kv_events,
            engine_host=urlsplit(spec.url).hostname or "127.0.0.1",
            bind=spec.kv_events_bind,
            on_resync=self._on_kv_resync,
        )
        self._subscribers[spec.id] = sub
        self._tasks.append(asyncio.create_task(sub.run(self._stop)))

    # ------------------------------------------------------------------ models
    async def served_model_ids(self) -> list[str]:
        """Configured model names and aliases; without a ``models`` table, the engines' own
        (asked at most every 10 s: clients poll /v1/models)."""
        if self.settings.models:
            return [n for m in self.settings.models for n in m.names()]
        now = self.clock()
        if self.session is not None and now - self._engine_models_at >= 10.0:
            urls = [t.url for t in self.targets.values()]
            self._engine_models = await fetch_served_models(self.session, urls) or (
                self._engine_models
            )
            self._engine_models_at = now
        return list(self._engine_models)

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
            engines=self._engine_kinds(),
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
            loads: dict[str, EngineLoad | None] = {}
            try:
                loads = await self.scraper.scrape_all()
            except Exception:  # one bad scrape must not stop the loop; say so, once a round
                log.exception("metrics scrape round failed")
            self._apply_loads(loads)
            self._publish_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), interval)

    def _apply_loads(self, loads: dict[str, EngineLoad | None]) -> None:
        """What the engines' own metrics say: understood or not, and their KV capacity (it
        replaces the predictor profile's unless the config names one)."""
        for iid, load in loads.items():
            if load is None:
                continue
            self.metrics.engine_metrics_understood.labels(iid).set(1 if load.understood else 0)
            spec = self.specs.get(iid)
            capacity = load.capacity_tokens
            if capacity and spec is not None and spec.capacity_tokens is None:
                self.conductor.set_capacity(iid, capacity)

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
