"""The Conductor: one pure, deterministic decision core for the gateway and the simulator.

``schedule(request, now)`` returns a ``Decision`` (prefill and decode instance, predictions,
replication commands) or a ``Rejection``; it does not change the books. ``dispatched`` commits a
decision; the event methods (prefill_done, first_token, tokens, finished, failed, kv_event,
replication_done, instance add/drain/remove/health) keep the books true to what happened.
Time is always an argument; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from config.settings import AdmissionMode, InstanceSettings, Role, Settings
from predictors.bundle import InstancePredictors, build_instance_predictors
from predictors.output_length import OutputLengthPredictor
from routing.admission import (
    Admission,
    EffectiveSLO,
    capacity_rejection,
    resolve_slo,
    unavailable_rejection,
)
from routing.cache_feedback import CacheFeedback, assess
from routing.cluster import DecodeWork, InstanceState
from routing.conditional_disagg import local_prefill
from routing.decode_placement import place_decode
from routing.estimates import STORE_SOURCE, PrefillOption, TTFTEstimator
from routing.hotspot import HotspotPlanner
from routing.kv_index import KVIndex
from routing.policies.base import PlacementContext, Policy
from routing.policies.registry import build_policy
from routing.types import (
    BlockRemoved,
    BlockStored,
    Decision,
    DecisionStats,
    KVEvent,
    Rejection,
    RejectReason,
    ReplicationCommand,
    RequestInfo,
    Tier,
)

PredictorFactory = Callable[[str | None], InstancePredictors]


@dataclass(slots=True)
class _ModelPools:
    prefill: list[InstanceState] = field(default_factory=list)
    decode: list[InstanceState] = field(default_factory=list)
    has_decode_pool: bool = False


@dataclass(slots=True)
class RequestRecord:
    request: RequestInfo
    decision: Decision
    dispatched_s: float
    pull_bytes: float = 0.0
    prefill_done_s: float | None = None
    first_token_s: float | None = None
    tokens: int = 0
    routed: tuple[int, ...] = ()  # blocks the route added to the prefill instance's view


class Conductor:
    def __init__(
        self,
        settings: Settings,
        predictors_for: PredictorFactory | None = None,
    ) -> None:
        self._predictor_cache: dict[str | None, InstancePredictors] = {}
        self._predictors_for = predictors_for or self._default_predictors
        self.settings = settings
        self.block_size = settings.routing.block_size
        self.instances: dict[str, InstanceState] = {}
        self.index = KVIndex(predicted_ttl_s=settings.routing.predict_on_route_ttl_s)
        self.output_lengths = OutputLengthPredictor(
            settings.predictors.output_length_history,
            settings.predictors.output_length_quantile,
            settings.predictors.default_output_tokens,
        )
        self.requests: dict[str, RequestRecord] = {}
        self._event_fed: set[str] = set()  # instances whose engine sends KV events
        self.stats = DecisionStats()
        self._order = 0
        self._prefill: list[InstanceState] = []
        self._decode: list[InstanceState] = []
        self._last_now = 0.0  # the latest time seen, for fleet changes made without one
        self.apply_settings(settings)
        for inst in settings.instances():
            self.add_instance(inst)

    # ------------------------------------------------------------------ configuration
    def _default_predictors(self, profile: str | None) -> InstancePredictors:
        if profile not in self._predictor_cache:
            self._predictor_cache[profile] = build_instance_predictors(
                self.settings.predictors, profile
            )
        return self._predictor_cache[profile]

    def apply_settings(self, settings: Settings) -> None:
        """Swap SLOs, policy and admission live (settings already validated)."""
        old = getattr(self, "settings", None)
        self.settings = settings
        self.admission = Admission(settings.admission)
        # A model's own SLO replaces the global one for its requests (priority classes apply).
        self._model_slo = {
            m.name: replace(
                settings.slo,
                ttft_s=m.ttft_s if m.ttft_s is not None else settings.slo.ttft_s,
                tbt_s=m.tbt_s if m.tbt_s is not None else settings.slo.tbt_s,
            )
            for m in settings.models
        }
        if (
            old is None
            or not hasattr(self, "policy")
            or (
                old.routing.policy,
                dict(old.routing.params),
            )
            != (settings.routing.policy, dict(settings.routing.params))
        ):
            self.policy: Policy = build_policy(settings.routing.policy, settings.routing.params)
            self.rng = random.Random(settings.routing.seed)
            if getattr(self, "instances", None):
                self._refresh_pools()  # a new policy learns the fleet it places on
        if old is None or not hasattr(self, "planner") or old.replication != settings.replication:
            self.planner = HotspotPlanner(settings.replication, settings.routing.block_size)

    def add_instance(self, spec: InstanceSettings) -> InstanceState:
        if spec.id in self.instances:
            raise ValueError(f"instance {spec.id!r} already exists")
        model = self.settings.served_model(spec.model) if spec.model else None
        preds = self._predictors_for(spec.profile or (model.profile if model else None))
        capacity = spec.capacity_tokens or preds.profile.kv_capacity_tokens
        inst = InstanceState(
            id=spec.id,
            role=spec.role,
            predictors=preds,
            capacity_tokens=capacity,
            max_batch=spec.max_batch,
            bit_order=self._order,
            model=spec.model,
        )
        self._order += 1
        self.instances[spec.id] = inst
        if inst.does_prefill:
            self.index.add_instance(
                spec.id,
                max(capacity // self.block_size, 1),
                spec.host_capacity_tokens // self.block_size,
            )
        self._refresh_pools()
        return inst

    def drain_instance(self, instance_id: str, draining: bool = True) -> None:
        self.instances[instance_id].draining = draining
        self._refresh_pools()

    def set_health(self, instance_id: str, healthy: bool) -> None:
        inst = self.instances.get(instance_id)
        if inst is not None and inst.healthy != healthy:
            inst.healthy = healthy
            self._refresh_pools()

    def remove_instance(self, instance_id: str, now: float) -> list[str]:
        """Forget an instance; returns the ids of requests that were on it (now failed)."""
        inst = self.instances.pop(instance_id)
        affected = [r for r in inst.clear_work() if r in self.requests]  # not peer replicas'
        for rid in affected:
            self._drop(rid, now)
        if inst.does_prefill:
            self.index.remove_instance(instance_id)
        self._event_fed.discard(instance_id)
        self.planner.forget_instance(instance_id)
        self._refresh_pools(now)
        return affected

    def _refresh_pools(self, now: float | None = None) -> None:
        if now is not None:
            self._last_now = max(self._last_now, now)
        ordered = sorted(self.instances.values(), key=lambda i: i.bit_order)
        self._prefill = [i for i in ordered if i.eligible and i.does_prefill]
        self._decode = [i for i in ordered if i.eligible and i.role is Role.DECODE]
        self._has_decode_pool = any(i.role is Role.DECODE for i in ordered)
        # Per served model: a request is only ever placed on its own model's instances.
        self._by_model: dict[str | None, _ModelPools] = {}
        for inst in ordered:
            pools = self._by_model.setdefault(inst.model, _ModelPools())
            pools.has_decode_pool |= inst.role is Role.DECODE
            if inst.eligible and inst.does_prefill:
                pools.prefill.append(inst)
            elif inst.eligible and inst.role is Role.DECODE:
                pools.decode.append(inst)
        both = [i for i in self._prefill if i.role is Role.BOTH]
        self.policy.on_fleet_change(both, self._last_now)

    # ------------------------------------------------------------------ decisions
    def schedule(
        self, req: RequestInfo, now: float, exclude: frozenset[str] = frozenset()
    ) -> Decision | Rejection:
        """Place ``req`` (not on the instances in ``exclude``: a retry avoids the one that
        just failed it), or reject it."""
        self._last_now = max(self._last_now, now)
        slo = resolve_slo(req, self._model_slo.get(req.model, self.settings.slo))
        prefill_pool, decode_pool = self._prefill, self._decode
        has_decode_pool = self._has_decode_pool
        if req.model is not None and self.settings.models:
            pools = self._by_model.get(req.model) or _ModelPools()
            prefill_pool, decode_pool = pools.prefill, pools.decode
            has_decode_pool = pools.has_decode_pool
        if exclude:
            prefill_pool = [i for i in prefill_pool if i.id not in exclude]
            decode_pool = [i for i in decode_pool if i.id not in exclude]
        if not prefill_pool:
            return self._reject_unavailable(req, RejectReason.NO_HEALTHY_PREFILL, slo)
        if has_decode_pool and not decode_pool:
            return self._reject_unavailable(req, RejectReason.NO_HEALTHY_DECODE, slo)
        match = self.index.match(req.block_hashes, now)
        predicted_output = self.output_lengths.predict(req.output_key, req.max_tokens)
        routing = self.settings.routing
        estimator = TTFTEstimator(
            req,
            match,
            now,
            block_size=self.block_size,
            threshold=routing.kvcache_balancing_threshold,
            min_transfer_blocks=routing.min_transfer_blocks,
            holders=self.instances,
            # Pulls are copies too: with replication off, prefixes are only reused in place.
            transfer_allowed=self.settings.replication.enabled
            and len(self.planner.in_flight) < self.settings.replication.max_in_flight,
        )
        ctx = PlacementContext(
            req,
            now,
            match,
            prefill_pool,
            decode_pool,
            estimator,
            self.rng,
            predicted_output,
            self.block_size,
            slo,
        )
        option = self.policy.select_prefill(ctx)
        if option.pull_source not in (None, STORE_SOURCE) and not self.planner.can_issue(
            option.instance.id
        ):
            option = estimator.local(option.instance)
        prefill = option.instance

        decode, tbt_now, tbt_check, retry_s = place_decode(
            ctx,
            prefill,
            option,
            self.policy,
            self.settings.routing.decode_placement,
            self.admission.mode,
        )
        if decode is None:
            return self._reject_capacity(req, slo, option)
        if routing.conditional_disagg and decode is not prefill:
            option = local_prefill(req, decode, option, slo, now) or option
            prefill = option.instance
        if self.admission.mode is AdmissionMode.PEER:
            rejection = self.admission.check_peer(self.policy, ctx, self.settings.routing.seed)
        else:
            rejection = self.admission.check(req, slo, option.ttft_s, tbt_check, retry_s)
        if rejection is not None:
            self._count_rejection(rejection)
            return rejection

        replications = self.planner.plan(
            req, ctx.match, ctx.prefill_candidates, self.instances, option, now
        )
        self.stats.replications += len(replications)
        self.stats.decisions += 1
        return Decision(
            request_id=req.request_id,
            prefill=prefill.id,
            decode=decode.id,
            predicted_ttft_s=option.ttft_s,
            predicted_tbt_s=tbt_now,
            predicted_queue_s=option.queue_s,
            predicted_prefill_s=option.prefill_s,
            predicted_transfer_s=option.transfer_s,
            predicted_load_s=option.load_s,
            predicted_output_tokens=predicted_output,
            cached_tokens=option.cached_tokens,
            prompt_tokens=req.prompt_tokens,
            policy=self.policy.name,
            reason=option.reason,
            priority=slo.priority.name,
            slo_ttft_s=slo.ttft_s,
            slo_tbt_s=slo.tbt_s,
            replications=replications,
            pull_source=option.pull_source,
        )

    def _reject_unavailable(
        self, req: RequestInfo, reason: RejectReason, slo: EffectiveSLO
    ) -> Rejection:
        rej = unavailable_rejection(req, reason, slo, self.settings.admission.retry_after_min_s)
        self._count_rejection(rej)
        return rej

    def _reject_capacity(
        self, req: RequestInfo, slo: EffectiveSLO, option: PrefillOption
    ) -> Rejection:
        rej = capacity_rejection(req, slo, option.ttft_s, self.settings.admission.retry_after_min_s)
        self._count_rejection(rej)
        return rej

    def _count_rejection(self, rej: Rejection) -> None:
        key = rej.reason.value
        self.stats.rejections[key] = self.stats.rejections.get(key, 0) + 1

    # ------------------------------------------------------------------ events
    def dispatched(self, decision: Decision, req: RequestInfo, now: float) -> None:
        prefill = self.instances[decision.prefill]
        decode = self.instances[decision.decode]
        record = RequestRecord(req, decision, now)
        ready = now + decision.predicted_transfer_s
        if decision.pull_source not in (None, STORE_SOURCE):
            record.pull_bytes = prefill.predictors.link.bytes_for(decision.cached_tokens)
            prefill.inbound_bytes += record.pull_bytes
            self.stats.transfers += 1
        work = prefill.enqueue_prefill(
            req.request_id,
            decision.predicted_prefill_s + decision.predicted_load_s,
            req.prompt_tokens,
            now,
            ready,
        )
        arrival = work.est_finish_s
        if decode is not prefill:
            arrival += decode.predictors.link.time(req.prompt_tokens)
        decode.add_incoming(
            DecodeWork(req.request_id, req.prompt_tokens, decision.predicted_output_tokens, arrival)
        )
        record.routed = self.index.record_route(prefill.id, req.block_hashes, now)
        self.requests[req.request_id] = record

    def prefill_done(self, request_id: str, now: float) -> None:
        rec = self.requests.get(request_id)
        if rec is None or rec.prefill_done_s is not None:
            return
        rec.prefill_done_s = now
        prefill = self.instances.get(rec.decision.prefill)
        if prefill is not None:
            prefill.finish_prefill(request_id, now)
            prefill.inbound_bytes = max(prefill.inbound_bytes - rec.pull_bytes, 0.0)
        decode = self.instances.get(rec.decision.decode)
        if decode is not None:
            decode.start_decode(request_id, now)

    def first_token(self, request_id: str, now: float) -> float | None:
        """Returns the observed TTFT (from dispatch)."""
        rec = self.requests.get(request_id)
        if rec is None:
            return None
        self.prefill_done(request_id, now)
        if rec.first_token_s is None:
            rec.first_token_s = now
        return rec.first_token_s - rec.dispatched_s

    def tokens(self, request_id: str, n: int, now: float) -> None:
        rec = self.requests.get(request_id)
        if rec is None:
            return
        rec.tokens += n
        decode = self.instances.get(rec.decision.decode)
        if decode is not None:
            decode.add_tokens(request_id, n, now)

    def finished(self, request_id: str, now: float, output_tokens: int | None = None) -> None:
        rec = self._drop(request_id, now)
        if rec is not None:
            out = output_tokens if output_tokens is not None else rec.tokens
            if out > 0:
                self.output_lengths.observe(rec.request.output_key, out)

    def failed(self, request_id: str, now: float) -> None:
        rec = self._drop(request_id, now)
        if rec is not None and rec.prefill_done_s is None and rec.routed:
            # Refused or lost before its prefill finished: the engine never cached the prompt.
            self.index.forget_route(rec.decision.prefill, rec.routed)

    def cache_feedback(
        self,
        request_id: str,
        now: float,
        engine_cached_tokens: int | None = None,
        engine_prompt_tokens: int | None = None,
    ) -> CacheFeedback | None:
        """The engine answered (call before ``finished``): its prefill instance now caches the
        prompt's full blocks. With the engine's report of the cached prompt tokens (and its
        prompt length, to scale its tokens to kvgate's), blocks the view believed cached but
        the engine had evicted also evict what was used less recently (``KVIndex.settle``);
        not on instances that send KV events (those report evictions themselves), nor for a
        P/D pair (the answer's report is the decode engine's)."""
        rec = self.requests.get(request_id)
        if rec is None:
            return None
        d, req = rec.decision, rec.request
        own_report = d.prefill == d.decode and d.pull_source is None
        fb = assess(
            d.prefill,
            req.prompt_tokens,
            d.cached_tokens,
            engine_cached_tokens if own_report else None,
            engine_prompt_tokens,
            self.block_size,
        )
        if d.prefill in self._event_fed:
            self.index.settle(d.prefill, req.block_hashes, 0, now)
        else:
            fb.dropped_blocks = self.index.settle(
                d.prefill, req.block_hashes, fb.missed_blocks, now, fb.extra_blocks
            )
        return fb

    def set_capacity(self, instance_id: str, capacity_tokens: int) -> None:
        """The engine reported its KV capacity (tokens): it replaces the profile's."""
        inst = self.instances.get(instance_id)
        if inst is None or capacity_tokens <= 0 or inst.capacity_tokens == capacity_tokens:
            return
        inst.capacity_tokens = capacity_tokens
        if instance_id in self.index:
            self.index.set_capacity(instance_id, max(capacity_tokens // self.block_size, 1))

    def _drop(self, request_id: str, now: float) -> RequestRecord | None:
        rec = self.requests.pop(request_id, None)
        if rec is None:
            return None
        prefill = self.instances.get(rec.decision.prefill)
        if prefill is not None and request_id in prefill.prefill_queue:
            prefill.finish_prefill(request_id, now)
            prefill.inbound_bytes = max(prefill.inbound_bytes - rec.pull_bytes, 0.0)
        decode = self.instances.get(rec.decision.decode)
        if decode is not None:
            decode.remove_decode(request_id, now)
        return rec

    def kv_event(self, instance_id: str, event: KVEvent, now: float) -> None:
        self._event_fed.add(instance_id)
        self.index.apply(instance_id, event, now)

    def evict(self, instance_id: str, block_hashes: tuple[int, ...], now: float) -> None:
        """The gateway knows the engine dropped these blocks without an event saying so (a
        llama.cpp slot it reused for another prompt); the instance stays feedback-corrected."""
        self.index.apply(instance_id, BlockRemoved(block_hashes), now)

    def replication_dropped(self, command_id: str) -> None:
        """A command that will not be executed (dry run): release its in-flight slot."""
        self.planner.drop(command_id)

    def replication_done(
        self, command_id: str, ok: bool, now: float, tier: Tier = Tier.GPU
    ) -> ReplicationCommand | None:
        """A copy finished. On success the destination holds the blocks (on ``tier``; a copy
        into the shared store makes them loadable by every instance); on failure the index
        is unchanged and a retry command may be returned."""
        entry = self.planner.in_flight.get(command_id)
        if entry is not None and ok:
            cmd = entry.command
            if tier is Tier.STORE:
                self.index.apply_store(BlockStored(cmd.block_hashes, Tier.STORE))
            elif cmd.destination in self.instances:
                self.index.apply(cmd.destination, BlockStored(cmd.block_hashes, tier), now)
        return self.planner.complete(command_id, ok, now)
