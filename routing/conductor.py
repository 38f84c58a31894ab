"""The Conductor: one pure, deterministic decision core for the gateway and the simulator.

``schedule(request, now)`` returns a ``Decision`` (prefill and decode instance, predictions,
replication commands) or a ``Rejection`` (which may carry the warm-up of a doomed request's
prompt, routing/doomed_warmup.py); it does not change the books. A request turned away on its
TBT check may wait for decode room (``park``, routing/parked_requests.py); ``reject_hopeless``
answers the rejections that need no prompt tokens (routing/hopeless.py). ``dispatched`` commits
a decision; the event methods (the request's progress in routing/request_progress.py, the
KV view's in routing/cache_view_events.py, instance add/drain/remove/health here) keep the
books true to what happened, as do the instance changes (add, drain, health, remove:
routing/fleet_membership.py). The eligible pools per model live in routing/fleet_pools.py.
Time is always an argument; nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from config.settings import AdmissionMode, Settings
from predictors.bundle import InstancePredictors, build_instance_predictors
from predictors.output_length import OutputLengthPredictor
from routing.admission import (
    Admission,
    EffectiveSLO,
    capacity_rejection,
    resolve_slo,
    unavailable_rejection,
)
from routing.best_effort import serve_best_effort
from routing.cache_view_events import CacheViewEvents
from routing.conditional_disagg import local_prefill
from routing.decode_placement import place_decode, tbt_fallback
from routing.decode_queue import DecodeQueue
from routing.doomed_warmup import plan_warmup
from routing.estimates import STORE_SOURCE, PrefillOption, TTFTEstimator
from routing.fleet_membership import FleetMembership
from routing.fleet_pools import FleetPools, ModelPools
from routing.hopeless import hopeless_rejection
from routing.hotspot import HotspotPlanner
from routing.instance_books import InstanceState
from routing.kv_index import KVIndex
from routing.llamacpp_slots import SlotBook
from routing.lora_affinity import LoraAffinity
from routing.parked_requests import ParkedRequests
from routing.policies.base import PlacementContext, Policy
from routing.policies.registry import build_policy
from routing.request_progress import RequestProgress, RequestRecord
from routing.types import (
    Decision,
    DecisionStats,
    Rejection,
    RejectReason,
    RequestInfo,
)

PredictorFactory = Callable[[str | None], InstancePredictors]
__all__ = ["Conductor", "PredictorFactory", "RequestRecord"]


class Conductor(RequestProgress, CacheViewEvents, ParkedRequests, FleetMembership):
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
        self.lora = LoraAffinity()  # engines' adapter slots, from their metrics
        # llama.cpp instances: which slot each request is pinned to (the gateway fills in the
        # slot counts as it reads /slots); placement weighs the prefixes a slot would lose.
        self.slots = SlotBook(max_waiting=settings.routing.llamacpp_slot_max_waiting)
        self._event_fed: set[str] = set()  # instances whose engine sends KV events
        self.stats = DecisionStats()
        self._order = 0
        self.pools = FleetPools()
        self._last_now = 0.0  # the latest time seen, for fleet changes made without one
        # Listeners outside the core (the replica exchange, gateway/replica_exchange.py): run
        # before each decision and after each dispatch. The core only calls them.
        self.before_schedule: list[Callable[[], object]] = []
        self.after_dispatch: list[Callable[[], object]] = []
        # ... and after each finished request (the gateway's decode waits, with ``now``).
        self.after_finished: list[Callable[[float], object]] = []
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
        if hasattr(self, "decode_queue"):  # what waits keeps waiting, under the new rules
            self.decode_queue.settings = settings.admission.decode_queue
        else:
            self.decode_queue = DecodeQueue(settings.admission.decode_queue)
        # A model's own SLO replaces the global one for its requests (priority classes apply).
        self._model_slo = {
            m.name: replace(
                settings.slo,
                ttft_s=m.ttft_s if m.ttft_s is not None else settings.slo.ttft_s,
                tbt_s=m.tbt_s if m.tbt_s is not None else settings.slo.tbt_s,
            )
            for m in settings.models
        }
        policy = (settings.routing.policy, dict(settings.routing.params))
        if (
            old is None
            or not hasattr(self, "policy")
            or (old.routing.policy, dict(old.routing.params)) != policy
        ):
            self.policy: Policy = build_policy(settings.routing.policy, settings.routing.params)
            self.rng = random.Random(settings.routing.seed)
            if getattr(self, "instances", None):
                self._refresh_pools()  # a new policy learns the fleet it places on
        self.lora.loads.cpu_adapters = settings.routing.lora_cpu_adapters
        self.lora.loads.fixed_s = settings.routing.lora_load_s
        if old is None or not hasattr(self, "planner") or old.replication != settings.replication:
            self.planner = HotspotPlanner(settings.replication, settings.routing.block_size)

    # ------------------------------------------------------------------ decisions
    def schedule(
        self,
        req: RequestInfo,
        now: float,
        exclude: frozenset[str] = frozenset(),
        parked: bool = False,
    ) -> Decision | Rejection:
        """Place ``req`` (not on the instances in ``exclude``: a retry avoids the one that
        just failed it), or reject it. ``parked``: a retry from the decode queue
        (routing/parked_requests.py), whose rejections count nowhere."""
        for hook in self.before_schedule:
            hook()
        self._last_now = max(self._last_now, now)
        slo = self.effective_slo(req)
        pools = self._pools_for(req)
        prefill_pool, decode_pool = pools.prefill, pools.decode
        has_decode_pool = pools.has_decode_pool
        if exclude:
            prefill_pool = [i for i in prefill_pool if i.id not in exclude]
            decode_pool = [i for i in decode_pool if i.id not in exclude]
        if not prefill_pool:
            return self._reject_unavailable(req, RejectReason.NO_HEALTHY_PREFILL, slo)
        if has_decode_pool and not decode_pool:
            return self._reject_unavailable(req, RejectReason.NO_HEALTHY_DECODE, slo)
        setup: dict[str, float] | None = None
        routing = self.settings.routing
        if req.lora is not None and routing.lora_affinity:
            prefill_pool = self.lora.candidates(req.lora, prefill_pool)
            if decode_pool:
                decode_pool = self.lora.candidates(req.lora, decode_pool)
            setup = self.lora.load_costs(req.lora, prefill_pool)
        match = self.index.match(req.block_hashes, now)
        predicted_output = self.output_lengths.predict(req.output_key, req.max_tokens)
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
            setup_s=setup,
            slots=self.slots if self.slots.instances else None,
            evict_weight=routing.llamacpp_evict_weight,
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
            self.pools.rotation,
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
            routing.decode_placement,
            self.admission.mode,
            routing.decode_rebind
            and self.policy.late_decode_binding
            and prefill.decode_after_prefill,
            self.admission.tbt_floor_s(slo),
            None if has_decode_pool else self.admission.stall_credit(req.model),
        )
        if decode is None:
            return self._reject_capacity(req, slo, option)
        moved = None
        if (
            decode is not prefill
            and not self.admission.tbt_passes(req, slo, tbt_check)
            and self.admission.may_move_decode(req)
            and not parked
        ):
            moved = tbt_fallback(ctx, decode, lambda t: self.admission.tbt_passes(req, slo, t))
            if moved is not None:
                decode, tbt_now, tbt_check, retry_s = moved
        if routing.conditional_disagg and decode is not prefill:
            option = local_prefill(req, decode, option, slo, now) or option
            prefill = option.instance
        late = False
        if self.admission.mode is AdmissionMode.PEER:
            rejection = self.admission.check_peer(self.policy, ctx, self.settings.routing.seed)
        else:
            late = serve_best_effort(
                req, option, tbt_check, slo, self.settings.admission, prefill_pool, now
            )
            rejection = self.admission.check(
                req,
                slo,
                option.ttft_s,
                tbt_check,
                retry_s,
                not late,
                bool(exclude) or parked,
                wait_s=option.queue_s,
            )
        if rejection is not None:
            if parked:
                return rejection
            self._count_rejection(rejection)
            return plan_warmup(
                ctx, slo, rejection, option, tbt_check, self.admission, self.policy.name
            )

        replications = self.planner.plan(
            req, ctx.match, ctx.prefill_candidates, self.instances, option, now
        )
        self.stats.replications += len(replications)
        self.stats.decisions += 1
        self.stats.best_effort += late
        self.stats.tbt_moves += moved is not None
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
            best_effort=late,
            waits_for=self.planner.pulls_into(prefill.id, req, option.cached_tokens),
            checked_tbt_s=tbt_check if tbt_check != tbt_now else None,
            adapter_load_s=setup.get(prefill.id) if setup else None,
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

    def effective_slo(self, req: RequestInfo) -> EffectiveSLO:
        """``req``'s SLOs: its model's (or the global ones), its class, its own overrides, and
        the share of the TBT headroom in force (routing/tbt_headroom.py)."""
        slo = resolve_slo(req, self._model_slo.get(req.model, self.settings.slo))
        slo.tbt_share = self.admission.headroom_for(req.model).share
        return slo

    def _pools_for(self, req: RequestInfo) -> ModelPools:
        return self.pools.for_model(req.model if self.settings.models else None)

    def reject_hopeless(self, req: RequestInfo, now: float) -> Rejection | None:
        """Before the prompt is tokenized: the ``ttft_slo`` rejection that ``schedule`` would
        also give, when even the shortest queue wait misses the TTFT SLO (routing/hopeless.py);
        counted like any rejection. ``req`` needs only its id, model, priority and SLO
        overrides; None means: tokenize and ``schedule`` as usual. Judged on the same view as
        ``schedule``: its listeners (a replica's catch-up on its peers' work) run first."""
        for hook in self.before_schedule:
            hook()
        self._last_now = max(self._last_now, now)
        slo = resolve_slo(req, self._model_slo.get(req.model, self.settings.slo))
        pools = self._pools_for(req)
        if not pools.prefill or (pools.has_decode_pool and not pools.decode):
            return None  # schedule answers no_healthy_* (503), not a TTFT rejection
        candidates = pools.prefill
        if self.settings.routing.conditional_disagg:  # a decode instance may prefill too
            candidates = [*candidates, *pools.decode]
        rej = hopeless_rejection(req.request_id, candidates, slo, self.settings.admission, now)
        if rej is not None:
            self._count_rejection(rej)
        return rej

    def withdraw(self, decision: Decision, rejection: Rejection) -> None:
        """A decision ``schedule`` made but the gateway turned away before ``dispatched`` (a
        tenant over its fair share): it counts as this rejection, not as a decision, and its
        replication commands release their in-flight slots."""
        for cmd in decision.replications:
            self.planner.drop(cmd.command_id)
        self.stats.replications -= len(decision.replications)
        self.stats.decisions -= 1
        self.stats.best_effort -= decision.best_effort
        self._count_rejection(rejection)

    # ------------------------------------------------------------------ events
    def swap_prefill_model(self, profile: str | None, prefill_model: object) -> int:
        """A refit prefill model for every instance of ``profile`` (None: all), swapped in one
        reference per instance (atomic as the event loop sees it); instances that shared a
        predictor bundle keep sharing one. Returns how many instances changed."""
        swapped: dict[int, InstancePredictors] = {}
        changed = 0
        for inst in self.instances.values():
            if profile is not None and inst.predictors.profile.name != profile:
                continue
            key = id(inst.predictors)
            if key not in swapped:
                swapped[key] = replace(inst.predictors, prefill=prefill_model)  # type: ignore[arg-type]
            inst.predictors = swapped[key]
            changed += 1
        return changed
