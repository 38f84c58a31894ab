"""Per-instance load the gateway itself accounts for: dispatched prefills and running decodes.

Engines report load late (scrapes) or not at all, so the core keeps its own books from what it
dispatched, with predicted durations, and corrects them when engines report progress
(prefill done, tokens, finished). All methods take ``now``; nothing reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from heapq import heappop, heappush

from config.settings import Role
from predictors.bundle import InstancePredictors
from routing.book_work import DecodeBook, DecodeWork, PrefillWork

__all__ = ["DecodeForecast", "DecodeWork", "InstanceState", "PrefillWork"]

# The recent prefill share is an exponentially weighted rate with this time constant: long
# enough to span several prefills, short enough to follow a change of load.
PREFILL_SHARE_TAU_S = 20.0
MAX_PREFILL_SHARE = 0.8  # the share's cap: a decode's expected TBT stays within 5x its step


@dataclass(slots=True)
class DecodeForecast:
    batch: int
    context_tokens: int
    tbt_s: float


@dataclass(eq=False)
class InstanceState:
    """One engine instance as the scheduler sees it."""

    id: str
    role: Role
    predictors: InstancePredictors
    capacity_tokens: int
    max_batch: int
    bit_order: int = 0  # registration order, the deterministic tie-break
    model: str | None = None  # served model (config ``models``); None = the only one
    # The decode leg goes out once this prefill instance has answered (vLLM's P/D protocol),
    # so the decode instance can still be chosen then (late decode binding); SGLang's legs
    # go out together.
    decode_after_prefill: bool = True
    healthy: bool = True
    draining: bool = False
    prefill_queue: dict[str, PrefillWork] = field(default_factory=dict)
    busy_until_s: float = 0.0  # as booked; prefill_free_s() corrects it for an overdue head
    queued_tokens: int = 0
    queued_prefill_s: float = 0.0  # predicted durations of the prefills in the queue, summed
    queue_scale: float = 1.0  # learned from answers (predictors/queue_scale.py); 1 = as booked
    # Predicted work of the prefills finished here, summed: a decode's share of it is the
    # prefill stall it sat through (colocated; DecodeWork.stall_mark_s).
    prefilled_s: float = 0.0
    # prefilled_s, exponentially decayed (PREFILL_SHARE_TAU_S) as of _share_at_s.
    _share_work_s: float = 0.0
    _share_at_s: float = 0.0
    incoming: dict[str, DecodeWork] = field(default_factory=dict)
    incoming_tokens: int = 0  # prompt tokens of the requests heading here
    _committed: float | None = None  # committed_tbt(0) once asked for; None after a change
    running: dict[str, DecodeWork] = field(default_factory=dict)
    batch: int = 0
    context_tokens: int = 0
    reserved_tokens: int = 0
    inbound_bytes: float = 0.0  # KV transfers in flight into this instance
    steps: float = 0.0  # decode steps run so far (estimated from predicted TBT)
    steps_at_s: float = 0.0
    _by_finish: DecodeBook = field(default_factory=DecodeBook)  # running, keyed by finish_step
    _by_arrival: DecodeBook = field(default_factory=DecodeBook)  # incoming, keyed by est_arrival_s

    # ---- eligibility ----
    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining

    @property
    def does_prefill(self) -> bool:
        return self.role is not Role.DECODE

    @property
    def does_decode(self) -> bool:
        return self.role is not Role.PREFILL

    @property
    def serves_plain_requests(self) -> bool:
        """Answers a request with no P/D fields (a warm-up): colocated engines and vLLM's P/D
        prefill do; an SGLang prefill server waits for its decode's bootstrap."""
        return self.role is Role.BOTH or self.decode_after_prefill

    @property
    def idle(self) -> bool:
        return not self.prefill_queue and not self.running and not self.incoming

    # ---- prefill queue (FCFS) ----
    def queue_time(self, now: float) -> float:
        """How long a new prefill would wait here: for the prefills booked before it and, on a
        colocated engine whose sequences are all taken (llama.cpp's ``-np`` slots, vLLM's
        ``max_num_seqs``), until a sequence leaves: there each request holds its place through
        its decode, so a prefill-only queue calls a full engine idle. Times the instance's
        learned ``queue_scale``."""
        t = self.prefill_start_s(now) - now
        return t * self.queue_scale if t > 0.0 else 0.0

    def prefill_start_s(self, now: float) -> float:
        """When a new prefill would start, as booked (``queue_time`` without the learned
        scale): after the booked prefills and, on a full colocated engine, a free sequence."""
        t = self.prefill_free_s(now)
        if self.role is Role.BOTH and self.batch + len(self.incoming) >= self.max_batch:
            free = self._sequence_free_s(now)
            if free > t:
                t = free
        return t

    def prefill_free_s(self, now: float) -> float:
        """When the booked prefills are done. A prefill past its booked finish has not ended
        (its first token ends it), so those behind it have not started: they still take their
        whole times from ``now`` (on an engine slower than predicted, a queue of unstarted
        prefills read as empty). The head's own remainder is unknown: counted as nothing."""
        queue = self.prefill_queue
        if not queue:
            return self.busy_until_s
        head = next(iter(queue.values()))
        behind = now + self.queued_prefill_s - head.duration_s
        return behind if behind > self.busy_until_s else self.busy_until_s

    def _sequence_free_s(self, now: float) -> float:
        """When a place frees for a newcomer: running decodes leave at their predicted finish;
        the requests booked but not decoding yet take the places that free first, in dispatch
        order, and hold them through their prefill and their decode. Steps take the TBT of
        a full engine: everything here decoding together."""
        clock = self.step_clock(now)
        tbt = self.predictors.decode.step_time(
            min(self.max_batch, self.batch + len(self.incoming)),
            self.context_tokens + self.incoming_tokens,
        )
        # The running book is in finish order, so these are ascending and, after the places
        # free now, the list is already a heap.
        leave = [now + max(w.finish_step - clock, 0.0) * tbt for w in self._by_finish]
        free = [now] * (self.max_batch - len(leave)) + leave[: self.max_batch]
        for rid, work in self.incoming.items():
            start = heappop(free)
            pre = self.prefill_queue.get(rid)
            if pre is not None:
                start = max(start, pre.est_start_s) + pre.duration_s
            heappush(free, start + work.expected_remaining() * tbt)
        return free[0]

    def enqueue_prefill(
        self, request_id: str, duration_s: float, prompt_tokens: int, now: float, ready_s: float
    ) -> PrefillWork:
        start = max(self.prefill_free_s(now), ready_s, now)
        work = PrefillWork(
            request_id, duration_s, start, start + duration_s, prompt_tokens, ready_s
        )
        self.prefill_queue[request_id] = work
        self.busy_until_s = work.est_finish_s
        self.queued_tokens += prompt_tokens
        self.queued_prefill_s += duration_s
        return work

    def finish_prefill(self, request_id: str, now: float) -> PrefillWork | None:
        work = self.prefill_queue.pop(request_id, None)
        if work is None:
            return None
        self._dequeued(work)
        self.prefilled_s += work.duration_s
        self._share_work_s = self._decayed_work(now) + work.duration_s
        self._share_at_s = max(now, self._share_at_s)
        # FCFS: the next queued prefill starts now; re-anchor the estimate on what remains.
        t = now
        for w in self.prefill_queue.values():
            w.est_start_s = max(t, w.ready_s)
            w.est_finish_s = w.est_start_s + w.duration_s
            t = w.est_finish_s
        self.busy_until_s = t if self.prefill_queue else now
        return work

    def remove_prefills(self, request_ids: list[str], now: float) -> None:
        """Take entries out without re-anchoring the rest on ``now`` (``finish_prefill`` does,
        as the engine just freed up): a started prefill keeps its predicted finish, the queued
        ones close up behind it. For other replicas' entries replaced by a newer snapshot."""
        for rid in request_ids:
            work = self.prefill_queue.pop(rid, None)
            if work is not None:
                self._dequeued(work)
        self._close_up(now)

    def lengthen_prefills(self, durations: Mapping[str, float], now: float) -> None:
        """Queued prefills will take longer than predicted (the engine evicted part of the
        prefix they were to reuse): the prefills behind them move back, in one pass."""
        longer = False
        for rid, duration_s in durations.items():
            work = self.prefill_queue.get(rid)
            if work is not None and duration_s > work.duration_s:
                self.queued_prefill_s += duration_s - work.duration_s
                work.duration_s = duration_s
                work.est_finish_s = work.est_start_s + duration_s
                longer = True
        if longer:
            self._close_up(now)

    def _dequeued(self, work: PrefillWork) -> None:
        self.queued_tokens -= work.prompt_tokens
        # Summed floats drift: an empty queue is exactly nothing.
        left = self.queued_prefill_s - work.duration_s
        self.queued_prefill_s = left if self.prefill_queue else 0.0

    def _close_up(self, now: float) -> None:
        """Re-anchor the prefills not yet started behind the ones before them."""
        t = now
        for w in self.prefill_queue.values():
            if w.est_start_s > now:
                w.est_start_s = max(t, w.ready_s)
                w.est_finish_s = w.est_start_s + w.duration_s
            t = max(t, w.est_finish_s)
        self.busy_until_s = t

    def _decayed_work(self, now: float) -> float:
        if now <= self._share_at_s:
            return self._share_work_s
        return self._share_work_s * math.exp((self._share_at_s - now) / PREFILL_SHARE_TAU_S)

    def prefill_share(self, now: float) -> float:
        """The share of its time the instance spent on prefill lately (predicted work of the
        prefills finished here, an exponentially weighted rate), at most MAX_PREFILL_SHARE.

        A colocated decode sharing the engine with prefills for a fraction ``u`` of its life
        makes its tokens at step / (1 - u) (each prefill step still yields one token); a
        colocated decision reports ``step * (1 + u)`` (routing/decode_placement.py), the
        first-order form, which predicted better on both simulated traces and on llama.cpp
        (docs/experiments.md §2.7): the stall checks turn away the prefills that would push
        the running decodes over, so the share a decode meets is lower than the share just
        past."""
        return min(self._decayed_work(now) / PREFILL_SHARE_TAU_S, MAX_PREFILL_SHARE)

    # ---- decode set ----
    def tbt_now(self, extra_batch: int = 0, extra_tokens: int = 0) -> float:
        return self.predictors.decode.step_time(
            self.batch + extra_batch, self.context_tokens + extra_tokens
        )

    def step_clock(self, now: float) -> float:
        """Decode steps run by ``now``: the clock advances at the predicted TBT."""
        if now > self.steps_at_s:
            if self.batch:
                self.steps += (now - self.steps_at_s) / max(self.tbt_now(), 1e-4)
            self.steps_at_s = now
        return self.steps

    def committed_tbt(self, prompt_tokens: int) -> float:
        """TBT once everything assigned here (running and still in prefill) and a new request
        of ``prompt_tokens`` decode together: the load-balancing key for decode placement.
        Ranking by the current batch alone herds requests onto an instance whose batch is
        small only because its newcomers are still in prefill."""
        return self.predictors.decode.step_time(
            self.batch + len(self.incoming) + 1,
            self.context_tokens + self.incoming_tokens + prompt_tokens,
        )

    @property
    def committed_key(self) -> float:
        """``committed_tbt(0)``: the decode-placement key. Cached between changes, so placement
        over many decode instances is one min() over mostly-cached values. (The newcomer's own
        prompt adds the same k*prompt to every instance of a profile.)"""
        key = self._committed
        if key is None:
            key = self._committed = self.committed_tbt(0)
        return key

    def _recommit(self) -> None:
        self._committed = None  # books changed: recompute when placement next asks

    def add_incoming(self, work: DecodeWork) -> None:
        self.incoming[work.request_id] = work
        self.incoming_tokens += work.prompt_tokens
        self._by_arrival.add(work.est_arrival_s, work)
        self.reserved_tokens += work.reserved_tokens
        self._recommit()

    def start_decode(self, request_id: str, now: float) -> DecodeWork | None:
        work = self.incoming.pop(request_id, None)
        if work is None:
            return None
        self.incoming_tokens -= work.prompt_tokens
        self._by_arrival.remove(work.est_arrival_s, work)
        work.started_s = now
        work.est_arrival_s = now
        work.stall_mark_s = self.prefilled_s
        work.finish_step = self.step_clock(now) + work.expected_remaining()
        self.running[request_id] = work
        self._by_finish.add(work.finish_step, work)
        self.batch += 1
        self.context_tokens += work.context_tokens
        self._recommit()
        return work

    def add_tokens(self, request_id: str, n: int, now: float) -> None:
        work = self.running.get(request_id)
        if work is None or n <= 0:
            return
        before = work.reserved_tokens
        self._by_finish.remove(work.finish_step, work)
        clock = self.step_clock(now)
        work.generated += n
        self.context_tokens += n
        self.reserved_tokens += work.reserved_tokens - before
        work.finish_step = clock + work.expected_remaining()
        self._by_finish.add(work.finish_step, work)
        self._recommit()

    def remove_decode(self, request_id: str, now: float) -> DecodeWork | None:
        work = self.running.pop(request_id, None)
        if work is not None:
            self.step_clock(now)
            self._by_finish.remove(work.finish_step, work)
            self.batch -= 1
            self.context_tokens -= work.context_tokens
        else:
            work = self.incoming.pop(request_id, None)
            if work is None:
                return None
            self.incoming_tokens -= work.prompt_tokens
            self._by_arrival.remove(work.est_arrival_s, work)
        self.reserved_tokens -= work.reserved_tokens
        self._recommit()
        return work

    def kv_fits(self, tokens: int) -> bool:
        return self.reserved_tokens + tokens <= self.capacity_tokens

    def takes_decode(self, need_tokens: int) -> bool:
        """Room for one more decode of ``need_tokens`` (prompt + predicted output)."""
        return self.kv_fits(need_tokens) and self.batch < self.max_batch

    def forecast(self, at_s: float, now: float, prompt_tokens: int) -> DecodeForecast:
        """Decode batch and TBT at ``at_s`` if a request of ``prompt_tokens`` arrives then.

        Mooncake's prediction-based early rejection: running decodes predicted to finish by
        then leave; requests now in prefill that will have moved here by then join.
        """
        batch = self.batch + 1
        tokens = self.context_tokens + prompt_tokens
        tbt = max(self.tbt_now(), 1e-4)
        horizon = self.step_clock(now) + max(at_s - now, 0.0) / tbt
        for w in self._by_finish.up_to(horizon):
            batch -= 1
            tokens -= w.context_tokens
        for w in self._by_arrival.up_to(at_s):
            batch += 1
            tokens += w.prompt_tokens
        if at_s > now and batch > 1:
            # Sequences still running grow by one token per step until then.
            grown = (batch - 1) * int((at_s - now) / tbt)
            tokens += min(grown, self.capacity_tokens)
        return DecodeForecast(batch, tokens, self.predictors.decode.step_time(batch, tokens))

    def next_finish_s(self, now: float) -> float | None:
        """When the first running sequence is predicted to finish."""
        first = self._by_finish.first()
        if first is None:
            return None
        left = first.finish_step - self.step_clock(now)
        return now + max(left, 0.0) * self.tbt_now()

    def clear_work(self) -> list[str]:
        """Forget all work (instance removed or died); returns the affected request ids."""
        ids = [*self.prefill_queue, *self.incoming, *self.running]
        self.prefill_queue.clear()
        self.incoming.clear()
        self.running.clear()
        self._by_finish.clear()
        self._by_arrival.clear()
        self.busy_until_s = self.steps = self.queued_prefill_s = 0.0
        self.queued_tokens = self.batch = self.context_tokens = self.reserved_tokens = 0
        self.incoming_tokens = 0
        self._recommit()
        self.inbound_bytes = 0.0
        return ids
