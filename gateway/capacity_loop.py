"""The capacity signal: ``kvgate_pool_instances_needed{pool}`` for an autoscaler (KEDA, HPA).

Runs on the gateway's scrape loop (``Gateway._publish_gauges``, every
``server.scrape_interval_s``). Each round it reads what was decided since the last one, without
touching the request path: the admitted requests from the learner's decision log (prompt and
cached tokens, instances), their expected output tokens from the Conductor's books while they
are in flight, and the number of refusals from the Conductor's counters. It feeds those to the
pure ``routing.capacity`` window and publishes the answer. The formula is in
``routing/capacity.py``; docs/capacity.md has the autoscaler wiring.

A request that finished before the round that reads it is no longer in the books: it counts
with the mean expected output of the others read in this round, or, if none, the output-length
predictor's global estimate.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from config.settings import Settings
from gateway.learning import DecisionRecord, Learner
from routing.capacity import (
    DEFAULT_MAX_UTILISATION,
    DEFAULT_TTFT_MISS_SHARE,
    DEFAULT_WINDOW_S,
    DemandSample,
    DemandWindow,
    PoolModel,
    PoolNeed,
    instances_needed,
)
from routing.conductor import Conductor

_ANY = 1 << 30  # no max_tokens cap on the predictor's global estimate


class CapacitySignal:
    def __init__(
        self,
        registry: CollectorRegistry,
        conductor: Conductor,
        learner: Learner,
        settings: Callable[[], Settings],
        *,
        window_s: float = DEFAULT_WINDOW_S,
        ttft_miss_share: float = DEFAULT_TTFT_MISS_SHARE,
        max_utilisation: float = DEFAULT_MAX_UTILISATION,
    ) -> None:
        self.conductor = conductor
        self.learner = learner
        self._settings = settings
        self.window = DemandWindow(window_s)
        self.ttft_miss_share = ttft_miss_share
        self.max_utilisation = max_utilisation
        self.needed = Gauge(
            "kvgate_pool_instances_needed",
            "Instances the pool needs to meet the SLOs at the demand of the last "
            f"{window_s:g} s (predictors; routing/capacity.py)",
            ["pool"],
            registry=registry,
        )
        self.instances = Gauge(
            "kvgate_pool_instances",
            "Instances of the pool taking traffic",
            ["pool"],
            registry=registry,
        )
        self.load = Gauge(
            "kvgate_pool_load_instances",
            "The unrounded instance count behind kvgate_pool_instances_needed",
            ["pool"],
            registry=registry,
        )
        self.last: dict[str, PoolNeed] = {}
        self._published: set[str] = set()
        self._last_seen: DecisionRecord | None = None
        self._refused_total: int | None = None

    def update(self, now: float) -> dict[str, PoolNeed]:
        """Read what happened since the last round, recompute, publish; returns the answer."""
        settings = self._settings()
        pool_of = {i.id: p.name for p in settings.pools for i in p.instances}
        self.window.start(now)
        self._read_decisions(pool_of)
        self._read_refusals(now)
        pools = self._pool_models(settings)
        self.last = instances_needed(
            self.window,
            pools,
            now,
            ttft_slo_s=settings.slo.ttft_s,
            tbt_slo_s=settings.slo.tbt_s,
            ttft_miss_share=self.ttft_miss_share,
            max_utilisation=self.max_utilisation,
        )
        for gone in set(self._published) - set(self.last):  # a pool left the configuration
            for gauge in (self.needed, self.instances, self.load):
                gauge.remove(gone)
        self._published = set(self.last)
        for name, need in self.last.items():
            self.needed.labels(name).set(need.needed)
            self.instances.labels(name).set(need.instances)
            self.load.labels(name).set(need.load_instances)
        return self.last

    def _new_records(self) -> list[DecisionRecord]:
        # The log is a bounded deque appended on the right: walk back to the last one read.
        fresh: list[DecisionRecord] = []
        for rec in reversed(self.learner.decisions):
            if rec is self._last_seen:
                break
            fresh.append(rec)
        if fresh:
            self._last_seen = fresh[0]
        fresh.reverse()
        return fresh

    def _read_decisions(self, pool_of: dict[str, str]) -> None:
        fresh = self._new_records()
        if not fresh:
            return
        outputs: list[int | None] = []
        for rec in fresh:
            booked = self.conductor.requests.get(rec.request_id)
            outputs.append(booked.decision.predicted_output_tokens if booked else None)
        known = [o for o in outputs if o is not None]
        # Already finished: the mean of this round's others, else the predictor's global view.
        fallback = (
            sum(known) / len(known) if known else self.conductor.output_lengths.predict(None, _ANY)
        )
        for rec, out in zip(fresh, outputs, strict=True):
            if rec.prefill not in pool_of or rec.decode not in pool_of:
                continue  # the instance left the configuration since
            self.window.add(
                DemandSample(
                    rec.at_s,
                    rec.prompt_tokens,
                    rec.cached_tokens,
                    out if out is not None else round(fallback),
                    pool_of[rec.prefill],
                    pool_of[rec.decode],
                )
            )

    def _read_refusals(self, now: float) -> None:
        total = sum(self.conductor.stats.rejections.values())
        if self._refused_total is not None and total > self._refused_total:
            self.window.add_refused(now, total - self._refused_total)
        self._refused_total = total

    def _pool_models(self, settings: Settings) -> list[PoolModel]:
        models = []
        for pool in settings.pools:
            states = [
                self.conductor.instances[i.id]
                for i in pool.instances
                if i.id in self.conductor.instances
            ]
            if not states:
                continue
            first = states[0]  # pools are homogeneous: one instance's predictors speak for all
            models.append(
                PoolModel(
                    name=pool.name,
                    role=pool.role,
                    instances=sum(1 for s in states if s.eligible),
                    prefill=first.predictors.prefill,
                    decode=first.predictors.decode,
                    kv_capacity_tokens=first.capacity_tokens,
                    max_batch=first.max_batch,
                )
            )
        return models
