"""The Conductor's books of placed requests: what happened to each one after its decision.

``dispatched`` commits a decision (the prefill queue, the decode instance's incoming work, the
prompt's route in the KV index), ``dispatched_warmup`` a doomed request's warm-up;
``rebind_decode`` may move the decode when the prefill is done; ``prefill_done``,
``first_token``, ``tokens``, ``finished``, ``failed`` and ``cache_feedback`` keep the books true
to what the engines did. A mixin of the Conductor (routing/conductor.py), which owns the state
named below; time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from predictors.output_length import OutputLengthPredictor
from routing.admission import Admission
from routing.cache_feedback import CacheFeedback, assess
from routing.decode_placement import rebind_target
from routing.doomed_warmup import warmup_request
from routing.estimates import STORE_SOURCE, TTFTEstimator, cached_tokens
from routing.fleet_pools import ModelPools
from routing.instance_books import DecodeWork, InstanceState
from routing.kv_index import KVIndex
from routing.lora_affinity import LoraAffinity
from routing.policies.base import Policy
from routing.types import Decision, DecisionStats, Rejection, RequestInfo


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
    stall_s: float | None = None  # predicted prefill work its decode sat through (colocated)


class RequestProgress:
    """Progress callbacks over the Conductor's state (declared here for the type checker)."""

    block_size: int
    instances: dict[str, InstanceState]
    index: KVIndex
    output_lengths: OutputLengthPredictor
    requests: dict[str, RequestRecord]
    stats: DecisionStats
    _event_fed: set[str]
    after_dispatch: list[Callable[[], object]]
    after_finished: list[Callable[[float], object]]
    _pools_for: Callable[[RequestInfo], ModelPools]
    policy: Policy
    admission: Admission
    lora: LoraAffinity

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
        if not decision.warmup:  # a warm-up never decodes
            decode.add_incoming(
                DecodeWork(
                    req.request_id, req.prompt_tokens, decision.predicted_output_tokens, arrival
                )
            )
        record.routed = self.index.record_route(prefill.id, req.block_hashes, now)
        self.requests[req.request_id] = record
        if req.lora is not None:
            self.lora.placed(req.lora, decision)
        for hook in self.after_dispatch:
            hook()

    def dispatched_warmup(
        self, rejection: Rejection, req: RequestInfo, now: float
    ) -> RequestInfo | None:
        """Commits the warm-up ``rejection`` carries for ``req`` (routing/doomed_warmup.py) and
        returns the request to send, whose progress is reported like any request's; None (and
        nothing booked) when a request with its id is in flight already (a client's own id)."""
        assert rejection.warmup is not None
        warm = warmup_request(req, rejection.warmup)
        if warm.request_id in self.requests:
            return None
        self.dispatched(rejection.warmup, warm, now)
        self.stats.warmups += 1
        return warm

    def rebind_decode(self, request_id: str, now: float) -> str | None:
        """Late decode binding (``routing.decode_rebind``): call when the prefill is done and
        before its KV leaves; returns the decode instance the request moved to, or None
        (stays). The books move with it: the old instance's incoming work to the new one."""
        rec = self.requests.get(request_id)
        if rec is None or rec.prefill_done_s is not None or not self.policy.late_decode_binding:
            return None
        d, req = rec.decision, rec.request
        planned, prefill = self.instances.get(d.decode), self.instances.get(d.prefill)
        if planned is None or d.decode == d.prefill or request_id not in planned.incoming:
            return None
        if prefill is not None and not prefill.decode_after_prefill:
            return None  # SGLang's decode leg left with the prefill's
        pool = self._pools_for(req).decode
        need = req.prompt_tokens + d.predicted_output_tokens
        target = rebind_target(planned, pool, req.prompt_tokens, need, d.slo_tbt_s)
        if target is None:
            return None
        if self._move_decode(rec, planned, target, now) is None:
            return None
        self.stats.rebinds += 1
        return target.id

    def _move_decode(
        self, rec: RequestRecord, planned: InstanceState, target: InstanceState, now: float,
        reason: str | None = None,
    ) -> Decision | None:  # fmt: skip
        """The decode's incoming work moves from ``planned`` to ``target`` (its KV arrives
        there from now on); None when ``planned`` has none for the request."""
        d = rec.decision
        work = planned.remove_decode(d.request_id, now)
        if work is None:
            return None
        work.est_arrival_s = now + target.predictors.link.time(rec.request.prompt_tokens)
        target.add_incoming(work)
        rec.decision = replace(d, decode=target.id, reason=reason or d.reason)
        if rec.request.lora is not None:
            self.lora.placed(rec.request.lora, rec.decision)
        return rec.decision

    def rebook(self, request_id: str, instance_id: str, now: float) -> Decision | None:
        """The request runs on ``instance_id``, not where it was decided: a proxy in front (Envoy
        behind the endpoint picker) could not reach the pick and took a fallback. The books
        follow it there, priced as that instance serves it (its own cached prefix, its queue,
        recomputing the rest); the pick forgets the route it was credited with. A P/D request
        whose decode instance could not be reached (its sidecar) moves its decode only. Before
        its first token; returns the new decision, else None (nothing moved)."""
        rec = self.requests.get(request_id)
        target = self.instances.get(instance_id)
        if rec is None or target is None or rec.first_token_s is not None:
            return None
        d, req = rec.decision, rec.request
        if d.prefill != d.decode:
            return self._rebook_decode(rec, target, now)
        if d.prefill == instance_id or rec.prefill_done_s is not None:
            return None
        self._drop(request_id, now)
        if rec.routed:
            self.index.forget_route(d.prefill, rec.routed)
        match = self.index.match(req.block_hashes, now)
        opt = TTFTEstimator(
            req, match, now, block_size=self.block_size, threshold=1.0,
            min_transfer_blocks=0, holders={}, transfer_allowed=False,
        ).local(target)  # fmt: skip
        moved = replace(
            d,
            prefill=target.id,
            decode=target.id,
            predicted_ttft_s=opt.ttft_s,
            predicted_queue_s=opt.queue_s,
            predicted_prefill_s=opt.prefill_s,
            predicted_transfer_s=0.0,
            predicted_load_s=opt.load_s,
            cached_tokens=opt.cached_tokens,
            reason="fallback",
            replications=(),
            pull_source=None,
            waits_for=(),
        )
        self.dispatched(moved, req, now)
        self.requests[request_id].dispatched_s = rec.dispatched_s  # its TTFT counts from then
        return moved

    def _rebook_decode(
        self, rec: RequestRecord, target: InstanceState, now: float
    ) -> Decision | None:
        planned = self.instances.get(rec.decision.decode)
        a_decode = target.does_decode and not target.does_prefill
        if planned is None or planned is target or not a_decode:
            return None
        return self._move_decode(rec, planned, target, now, "fallback")

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
            if rec.request.lora is not None and not rec.decision.warmup:
                self.lora.first_token(rec.decision, now - rec.dispatched_s)
        return rec.first_token_s - rec.dispatched_s

    def tokens(self, request_id: str, n: int, now: float) -> None:
        rec = self.requests.get(request_id)
        if rec is None:
            return
        rec.tokens += n
        decode = self.instances.get(rec.decision.decode)
        if decode is not None:
            decode.add_tokens(request_id, n, now)

    def finished(
        self,
        request_id: str,
        now: float,
        output_tokens: int | None = None,
        decode_timed: bool = True,
        tbt_s: float | None = None,
    ) -> None:
        """``tbt_s``: the request's mean TBT where the caller measured it (the simulator);
        else taken from the first token on, when ``decode_timed`` (the tokens arrived as
        they were made, streamed: a whole answer says nothing of its TBT)."""
        rec = self._drop(request_id, now)
        if rec is not None and not rec.decision.warmup:  # its one token tells nothing
            out = output_tokens if output_tokens is not None else rec.tokens
            if out > 0:
                self.output_lengths.observe(rec.request.output_key, out)
            first = rec.first_token_s
            # A whole answer's first token came with its last: no TTFT to learn from.
            if first is not None and not rec.decision.best_effort and (decode_timed or out <= 1):
                late = first - rec.dispatched_s > rec.decision.slo_ttft_s
                self.admission.observe_first_token(rec.request.model, late)
            if tbt_s is None and decode_timed and first is not None and out > 1:
                tbt_s = (now - first) / (out - 1)
            if tbt_s is not None:
                slo = rec.decision.slo_tbt_s
                stall_missed = None  # not colocated: no prefill ran beside it
                if rec.decision.decode == rec.decision.prefill and rec.stall_s is not None:
                    # Missed because of the prefills it sat through: it met its SLO without them.
                    stall_missed = tbt_s > slo and tbt_s - rec.stall_s / max(out - 1, 1) <= slo
                self.admission.observe_decode(rec.request.model, tbt_s > slo, stall_missed)
        for hook in self.after_finished:  # its decode room is free (gateway/decode_waits.py)
            hook(now)

    def failed(self, request_id: str, now: float, decode_refused: bool = False) -> None:
        """``decode_refused``: the decode engine turned the request away at join for its TBT
        (the simulator's Mooncake-style engines do): a miss for the TBT headroom.

        A request that failed otherwise (its client left, the engine errored, the stream broke)
        left its decode batch as a finished one does, so the ``after_finished`` hooks run: a
        request waiting for decode room must not wait for the next *completed* decode. A
        refused one never joined the batch: nothing was freed."""
        rec = self._drop(request_id, now)
        if rec is None:
            return
        if decode_refused:
            self.admission.observe_decode(rec.request.model, True)
        if rec.prefill_done_s is None and rec.routed:
            # Refused or lost before its prefill finished: the engine never cached the prompt.
            self.index.forget_route(rec.decision.prefill, rec.routed)
        if not decode_refused:
            for hook in self.after_finished:
                hook(now)

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

    def prefix_evicted(self, instance_id: str, block_hashes: tuple[int, ...], now: float) -> None:
        """The engine evicted blocks (a KV event). Queued prefills there that counted on them
        will recompute that part, so the queue behind them is longer than booked: without
        this, a prefix evicted while its request waited (long queues at overload) delayed
        everyone queued after it, and admission kept promising TTFTs the queue could no
        longer keep. Prefills already started keep their estimate (the engine matched)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        waiting = [
            (rid, rec)
            for rid, work in inst.prefill_queue.items()
            if work.est_start_s > now
            and (rec := self.requests.get(rid)) is not None
            and rec.decision.cached_tokens > 0
        ]
        if not waiting:  # the common case: look nothing up
            return
        # Gone from the instance, not just moved to its host tier (loaded, not recomputed).
        removed = {h for h in block_hashes if not self.index.holds(instance_id, h)}
        if not removed:
            return
        longer: dict[str, float] = {}
        for rid, rec in waiting:
            d, req = rec.decision, rec.request
            reused = req.block_hashes[: -(-d.cached_tokens // self.block_size)]
            kept = next((i for i, h in enumerate(reused) if h in removed), None)
            if kept is None:
                continue
            cached = cached_tokens(kept, self.block_size, req.prompt_tokens)
            prefill = inst.predictors.prefill.predict(req.prompt_tokens - cached, cached)
            longer[rid] = prefill + d.predicted_load_s
        inst.lengthen_prefills(longer, now)

    def _drop(self, request_id: str, now: float) -> RequestRecord | None:
        rec = self.requests.pop(request_id, None)
        if rec is None:
            return None
        if rec.request.lora is not None:
            self.lora.left(request_id)
        prefill = self.instances.get(rec.decision.prefill)
        if prefill is not None and request_id in prefill.prefill_queue:
            prefill.finish_prefill(request_id, now)
            prefill.inbound_bytes = max(prefill.inbound_bytes - rec.pull_bytes, 0.0)
        decode = self.instances.get(rec.decision.decode)
        if decode is not None:
            work = decode.remove_decode(request_id, now)
            if work is not None and work.started_s is not None:
                rec.stall_s = decode.prefilled_s - work.stall_mark_s
        return rec
