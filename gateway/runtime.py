"""One running gateway: the Conductor plus everything with I/O around it.

Owns the HTTP clients (backends/http1.py: pooled keep-alive connections for the engine legs;
an aiohttp session for health checks, scrapes and replication), the protocol drivers, health
checks and circuit breakers, the metrics scraper, KV-event subscribers, the replication sink,
metrics, tracing and the learner. Settings changes from the admin API are
validated and applied here. The clock is injectable (monotonic seconds) for tests.

The engine legs report their outcomes to ``legs`` (gateway/leg_health.py: circuit breakers,
ejection, probes). ``silence_timeout`` is how long an engine may send nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import aiohttp

from backends.drivers import ProtocolDriver, Target, driver_for
from backends.health import HealthChecker
from backends.http1 import Http1Client
from backends.model_files import make_prompt_encoder
from backends.predictor_files import predictor_factory
from backends.profile_file import load_measured_profiles
from backends.prometheus import EngineLoad
from backends.scraper import MetricsScraper
from backends.stop_wait import wait_or_stop
from backends.transport import IDLE_KEEPALIVE_S
from config.settings import InstanceSettings, PDProtocol, PoolSettings, Role, Settings
from config.tenant_keys import tenant_keys
from gateway.capacity_loop import CapacitySignal
from gateway.decode_waits import DecodeWaits
from gateway.drain import Drain
from gateway.kv_feeds import KvEventFeeds
from gateway.learning import Learner, refit_loop
from gateway.leg_health import LegHealth
from gateway.llamacpp_pinning import SlotPinning
from gateway.metrics import GatewayMetrics
from gateway.models import ModelRoute, ServedModels, adapter_routes, build_model_routes
from gateway.openai import ParsedRequest, RequestHead, parse_head, parse_prompt
from gateway.relay import cache_report
from gateway.replica_exchange import ReplicaExchange
from gateway.replica_metrics import ReplicaExchangeCollector
from gateway.replicator import EngineView, Replicator, TargetUrls
from gateway.response_owners import ResponseOwners
from gateway.silence import silence_timeout_s
from gateway.tokenize_ahead import TokenizeAhead
from gateway.tracing import Tracing
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.lora_affinity import EngineAdapters
from routing.types import Decision

log = logging.getLogger("kvgate.gateway")


class Gateway:
    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        # predictors.profile_file: a profile measured on the user's engine, and
        # predictors.prefill_model_file, read here (the edge) and handed to the core as data.
        self.measured_profiles = load_measured_profiles(settings.predictors)
        self.conductor = Conductor(
            settings, predictor_factory(settings.predictors, self.measured_profiles)
        )
        self.metrics = GatewayMetrics()
        self.tokenizing = TokenizeAhead(self.metrics.tokenized_ahead)  # long prompts: threads
        self.tracing = Tracing(settings.server)
        self.prompt_encoder = make_prompt_encoder(settings.routing)
        self.hasher = BlockHasher(settings.routing.block_size)
        # Per served model (config ``models``): its encoder and key space; else the one above.
        self.default_route = ModelRoute(None, self.prompt_encoder, self.hasher)
        self.model_routes, self.instance_routes = build_model_routes(settings)
        self.adapter_routes = adapter_routes(settings, self.default_route)  # no models table
        self.learner = Learner(
            self.conductor,
            settings.server.recent_decisions,
            settings.server.refit_min_samples,
            min_new_samples=settings.server.refit_min_new_samples,
            window=settings.server.refit_window,
            prior=self.measured_profiles.prior(),  # refits continue from the sweeps
            queue_scale_rate=settings.predictors.queue_scale_rate,
        )
        # kvgate_pool_instances_needed: demand read each scrape round (gateway/capacity_loop.py)
        self.capacity = CapacitySignal(
            self.metrics.registry, self.conductor, self.learner, lambda: self.settings
        )
        self.targets: dict[str, Target] = {}
        self.specs: dict[str, InstanceSettings] = {}
        # Leg outcomes and probes -> instance health (breakers; the checker set at startup).
        self.legs = LegHealth(self.conductor, self.metrics, clock)
        self.session: aiohttp.ClientSession | None = None  # health checks and scrapes
        self.client = Http1Client()  # the engine legs (pooled keep-alive connections)
        self.scraper: MetricsScraper | None = None
        self.kv_feeds = KvEventFeeds(
            self.conductor,
            clock,
            lambda iid: self.instance_routes.get(iid, self.default_route).hasher,
        )
        # llama.cpp instances: which slot each request is pinned to, slot files, host caches
        self.llamacpp = SlotPinning(
            lambda: self.settings.routing,
            self.conductor,
            self.metrics,
            self.targets,
            lambda: self.session,
            clock,
        )
        self.slot_book = self.llamacpp.book
        self.slot_files = self.llamacpp.files
        # `kvgate epp` with P/D: Envoy reaches decode instances through their sidecars, so
        # that is what is probed (a dead sidecar would otherwise look healthy)
        self.health_via_sidecars = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._scraped = asyncio.Event()  # the first round of engine metrics is in
        self.served_models = ServedModels(
            lambda: self.settings, lambda: [t.url for t in self.targets.values()], clock
        )
        # Which instance made each Responses API answer (shared with the other replicas).
        self.response_owners = ResponseOwners(shared=settings.replicas.enabled)
        # Other kvgate replicas' dispatched work counts as load here (docs/replicas.md).
        self.replicas = (
            ReplicaExchange(settings.replicas, self.conductor, clock, owners=self.response_owners)
            if settings.replicas.enabled
            else None
        )
        if self.replicas is not None:  # kvgate_replica_*: read at scrape time
            self.metrics.registry.register(ReplicaExchangeCollector(self.replicas))
        self.drain = Drain(clock)  # SIGTERM: stop taking requests, finish or abort the rest
        # Requests turned away on the TBT check that wait for decode room (routing/decode_queue.py).
        self.decode_waits = DecodeWaits(self.conductor, clock)
        self.drain.on_begin.append(self.decode_waits.end_all)
        # Tenants' API key hashes (config and keys file), read here and on reload, never on
        # the request path (gateway/tenants.py takes them from here).
        self.tenant_keys = tenant_keys(settings.tenants)
        self.config_path: str | None = None  # the file a reload reads (``kvgate serve``)
        self.reload_lock = asyncio.Lock()  # SIGHUP and POST /admin/reload, one at a time
        for spec in settings.instances():
            self._register(spec)
        self.driver: ProtocolDriver = self._make_driver()
        self.replicator = Replicator(
            lambda: self.settings,
            self.conductor,
            self.metrics,
            clock,
            EngineView(
                urls=TargetUrls(self.targets),
                sends_kv_events=self.kv_feeds.sends_events,
                engine_block_tokens=self._engine_block_tokens,
                pin=self.pin_slot,
                unpin=self.unpin_slot,
            ),
        )

    # ------------------------------------------------------------------ instances
    def _register(self, spec: InstanceSettings) -> None:
        self.specs[spec.id] = spec
        self.targets[spec.id] = Target(
            spec.id, spec.url.rstrip("/"), spec.bootstrap_port, spec.kv_connector
        )
        self.legs.add(spec.id)

    def _make_driver(self) -> ProtocolDriver:
        specs = list(self.specs.values())
        disaggregated = any(s.role is Role.DECODE for s in specs)
        protocol = next((s.protocol for s in specs), None)
        return driver_for(protocol or PDProtocol.VLLM, disaggregated, self.client)

    def _http_targets(self) -> dict[str, str]:
        return {iid: t.url for iid, t in self.targets.items()}

    def _health_targets(self) -> dict[str, str]:
        """Where each instance's health is probed: its engine, or behind Envoy
        (``health_via_sidecars``) its P/D sidecar, which answers for itself and its engine."""
        out = self._http_targets()
        if self.health_via_sidecars:
            for iid, spec in self.specs.items():
                if spec.sidecar_url and iid in out:
                    out[iid] = spec.sidecar_url
        return out

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
            self._tasks.append(self.kv_feeds.subscribe(spec, self._stop))

    def remove_instance(self, instance_id: str) -> list[str]:
        affected = self.conductor.remove_instance(instance_id, self.clock())
        self.specs.pop(instance_id, None)
        self.targets.pop(instance_id, None)
        self.legs.remove(instance_id)
        self.kv_feeds.remove(instance_id)
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
        if self.legs.checker is not None:
            self.legs.checker.set_targets(self._health_targets())
        if self.scraper is not None:
            self.scraper.set_targets(self._http_targets(), self._engine_kinds())

    def apply_settings(self, settings: Settings) -> None:
        """Swap SLOs, policy, admission, replication, timeouts live (already validated)."""
        self.conductor.apply_settings(settings)
        self.settings = settings
        if (checker := self.legs.checker) is not None:
            srv = settings.server
            checker.set_timing(srv.health_interval_s, srv.health_timeout_s, srv.health_recheck_s)

    async def parse(
        self, path: str, raw: bytes, headers: Mapping[str, str], request_id: str
    ) -> ParsedRequest:
        """A completion request as the core needs it, with this gateway's settings, encoder,
        key space and models (serve and epp alike); raises BadRequest."""
        head = self.parse_head(raw)
        await self.tokenize_ahead(path, head)
        return self.parse_prompt(path, head, headers, request_id)

    async def tokenize_ahead(self, path: str, head: RequestHead) -> None:
        """A long prompt tokenized in a worker thread (gateway/tokenize_ahead.py)."""
        limit = self.settings.routing.tokenize_offload_chars
        await self.tokenizing(path, head, self.prompt_encoder, limit)

    def parse_head(self, raw: bytes) -> RequestHead:
        """The body's JSON, ``stream`` and served model, before any prompt work (the proxy's
        hopeless check needs no more); raises BadRequest."""
        return parse_head(raw, self.model_routes, self.adapter_routes)

    def parse_prompt(
        self, path: str, head: RequestHead, headers: Mapping[str, str], request_id: str
    ) -> ParsedRequest:
        """The rest of ``parse``: the prompt encoded and hashed in its model's key space."""
        return parse_prompt(
            path,
            head,
            headers,
            request_id,
            self.clock(),
            settings=self.settings,
            encoder=self.prompt_encoder,
            hasher=self.hasher,
        )

    def silence_timeout(self, d: Decision, whole_answer_tokens: int = 0) -> float:
        """How long an engine that took this request may send nothing (gateway/silence.py)."""
        return silence_timeout_s(self.settings.server, d, whole_answer_tokens)

    def cache_reported(self, request_id: str, now: float, answer_tail: bytes) -> None:
        """The engine's answer corrects the cache view (what it had cached, what it now has);
        call before ``Conductor.finished``."""
        fb = self.conductor.cache_feedback(request_id, now, *cache_report(answer_tail))
        if fb is not None:
            self.metrics.cache_feedback(fb)

    # ------------------------------------------------------------------ llama.cpp slots
    def pin_slot(self, request_id: str, instance_id: str, blocks: Sequence[int]) -> int | None:
        return self.llamacpp.pin(request_id, instance_id, blocks)

    def unpin_slot(self, request_id: str) -> None:
        self.llamacpp.unpin(request_id)

    async def restore_slot(self, request_id: str) -> None:
        await self.llamacpp.restore(request_id)

    def cached_tokens(self, d: Decision) -> int:
        return self.llamacpp.cached_tokens(d)

    # ------------------------------------------------------------------ replication
    def _engine_block_tokens(self, instance_id: str) -> int | None:
        """The engine's KV block size as its /metrics state it (vLLM, SGLang); None if unknown."""
        load = self.scraper.latest(instance_id, self.clock()) if self.scraper else None
        return load.block_size if load is not None else None

    # ------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,
            ttl_dns_cache=300,
            enable_cleanup_closed=True,
            keepalive_timeout=IDLE_KEEPALIVE_S,
        )
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        await self.replicator.start(self.session)
        srv = self.settings.server
        health = self.legs.checker = HealthChecker(
            self.session,
            self._health_targets(),
            interval_s=srv.health_interval_s,
            timeout_s=srv.health_timeout_s,
            recheck_s=srv.health_recheck_s,
            on_change=self.legs.changed,
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
        self._tasks.append(asyncio.create_task(health.run(self._stop)))
        self._tasks.append(asyncio.create_task(self._scrape_loop()))
        if srv.refit_interval_s > 0:
            refits = refit_loop(self.learner, srv.refit_interval_s, self._stop)
            self._tasks.append(asyncio.create_task(refits))
        for spec in self.specs.values():
            if spec.kv_events_endpoint:
                self._tasks.append(self.kv_feeds.subscribe(spec, self._stop))
        if self.replicas is not None:
            self.replicas.start()
            self._tasks.append(asyncio.create_task(self.replicas.run(self._stop)))
        self._tasks += await self.llamacpp.start(self._stop)
        await self.llamacpp.settled(self._scraped, srv.startup_wait_s)

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
            self._scraped.set()
            self._publish_gauges()
            await wait_or_stop(self._stop, interval)

    def _apply_loads(self, loads: dict[str, EngineLoad | None]) -> None:
        """What the engines' own metrics say: understood or not, their KV capacity and llama.cpp's
        slot count (each replaces the predictor profile's unless the config names one), and
        vLLM's adapter slots (LoRA affinity)."""
        for iid, load in loads.items():
            if load is None:
                continue
            self.metrics.engine_metrics_understood.labels(iid).set(1 if load.understood else 0)
            spec = self.specs.get(iid)
            capacity = load.capacity_tokens
            if load.slots:
                self.llamacpp.slots_seen(iid, load.slots)
            if load.slots and spec is not None and spec.max_batch is None:
                self.conductor.set_max_batch(iid, load.slots)
            if capacity and spec is not None and spec.capacity_tokens is None:
                self.conductor.set_capacity(iid, capacity)
            if load.understood:  # vLLM with --enable-lora: its adapter slots (else none)
                running = load.running_adapters or frozenset()
                slots = EngineAdapters(load.max_loras, running) if load.max_loras else None
                self.conductor.lora.engine_state(iid, slots)

    def _publish_gauges(self) -> None:
        now = self.clock()
        for inst in self.conductor.instances.values():
            self.metrics.queue.labels(inst.id).set(inst.queue_time(now))
            self.metrics.queue_scale.labels(inst.id).set(inst.queue_scale)
            self.metrics.batch.labels(inst.id).set(inst.batch)
        self.metrics.publish_learned(self.conductor.admission)
        self.metrics.decode_rebinds.set(self.conductor.stats.rebinds)
        self.metrics.decode_tbt_moves.set(self.conductor.stats.tbt_moves)
        queue = self.conductor.decode_queue
        self.metrics.decode_queue.labels("waiting").set(len(queue))
        self.metrics.decode_queue.labels("admitted").set(queue.admitted)
        self.metrics.decode_queue.labels("expired").set(queue.expired)
        self.capacity.update(now)

    async def shutdown(self) -> None:
        self._stop.set()
        if self.legs.checker is not None:
            self.legs.checker.cancel_probes()
        self.kv_feeds.close()
        if self.replicas is not None:
            self.replicas.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.replicator.close()
        await self.llamacpp.close()
        if self.session is not None:
            await self.session.close()
        self.client.close()
        self.tokenizing.close()
        self.tracing.shutdown()
