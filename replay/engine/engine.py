"""A step-level model of one engine instance (vLLM / SGLang style continuous batching).

Prefill-only, decode-only and colocated instances are the same machine with different work:
each step runs prefill chunks (FCFS) plus one token for every decoding sequence, and takes
``StepTiming.step`` time. While only decodes run, consecutive steps are planned as one
segment that ends at the next change (a sequence finishing or a sequence joining), so a long
decode costs one event, not one per token.

The model is pure: the caller (simulator or emulator) asks ``next_event_s()`` and calls
``advance(t)`` at that time; submissions between events cut the current segment at the next
step boundary, where the newcomer joins (continuous batching).

With ``max_adapters`` (vLLM's ``--max-loras``) a batch runs at most that many distinct LoRA
adapters: a waiting request for another adapter is skipped, not queued behind (vLLM's
scheduler defers it and takes the requests after it), until every request of a running
adapter has left the batch. An adapter that is not among the last ``max_cached_adapters`` used
(vLLM's ``--max-cpu-loras`` host cache) is read in first: the step that runs it takes
``adapter_load_s`` longer (vLLM loads it inside that step).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from config.settings import Role
from replay.engine.prefix_cache import PrefixCache
from replay.engine.timing import StepTiming
from routing.adapter_loads import use_adapters


@dataclass(slots=True)
class PrefillJob:
    request_id: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int  # used by colocated engines, which decode what they prefilled
    block_size: int
    cached_tokens: int = -1  # known when the job starts
    done: int = 0  # new tokens processed so far
    started_s: float | None = None
    adapter: str | None = None  # the LoRA adapter it runs under

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True)
class DecodeSeq:
    request_id: str
    prompt_tokens: int
    remaining: int  # tokens still to generate
    generated: int = 0
    reported: int = 0  # tokens already reported to the caller's books
    # When the batch took it in (a step boundary): P/D engines stream the first token from
    # here on, not from the KV's arrival (vLLM recomputes the last prompt token in this
    # step; SGLang's decode emits the prefill's token at this scheduler pass).
    joined_s: float | None = None
    adapter: str | None = None  # the LoRA adapter it runs under
    # A colocated request's decode: it ran its prefill in this batch, so its adapter already
    # holds a slot (vLLM keeps it in the running set); a P/D decode leg must get one.
    admitted: bool = False

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class PrefillDone:
    request_id: str
    cached_tokens: int
    start_s: float
    end_s: float


@dataclass(slots=True)
class StepReport:
    prefilled: list[PrefillDone] = field(default_factory=list)
    finished: list[DecodeSeq] = field(default_factory=list)
    # Token-level time between tokens: (step seconds, tokens produced at that step time).
    tbt: list[tuple[float, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Plan:
    end_s: float
    steps: int = 1  # > 1 only for decode-only segments
    chunks: list[tuple[PrefillJob, int]] = field(default_factory=list)
    start_s: float = 0.0
    batch: int = 0
    context: int = 0
    extra_s: float = 0.0  # adapter loads inside this plan
    adapters: tuple[str, ...] = ()  # the adapters it runs (the host cache's recency)


class Engine:
    def __init__(
        self,
        instance_id: str,
        role: Role,
        timing: StepTiming,
        *,
        cache: PrefixCache | None,
        max_batch: int,
        kv_capacity_tokens: int,
        chunk_tokens: int | None = None,
        decode_tbt_limit_s: float | None = None,
        max_segment_steps: int | None = None,
        max_adapters: int | None = None,
        adapter_load_s: float = 0.0,
        max_cached_adapters: int | None = None,
    ) -> None:
        if max_adapters is not None and max_adapters < 1:
            raise ValueError("max_adapters must be >= 1")
        cached = max_cached_adapters if max_cached_adapters is not None else max_adapters
        if adapter_load_s < 0 or (cached is not None and max_adapters and cached < max_adapters):
            raise ValueError("adapter_load_s must be >= 0, max_cached_adapters >= max_adapters")
        self.id = instance_id
        self.role = role
        self.timing = timing
        self.cache = cache
        self.max_batch = max_batch
        self.kv_capacity_tokens = kv_capacity_tokens
        self.chunk_tokens = chunk_tokens
        self.decode_tbt_limit_s = decode_tbt_limit_s
        # The emulator streams tokens as they are made, so it plans one step at a time (1);
        # the simulator skips ahead to the next change (None).
        self.max_segment_steps = max_segment_steps
        self.max_adapters = max_adapters
        self.adapter_load_s = adapter_load_s
        self.max_cached_adapters = cached
        self.cached_adapters: OrderedDict[str, None] = OrderedDict()  # least recent first
        self.queue: deque[PrefillJob] = deque()
        self.running: dict[str, DecodeSeq] = {}
        self.joining: deque[DecodeSeq] = deque()
        self.context_tokens = 0
        self.reserved_tokens = 0
        self.clock_s = 0.0  # end of the last applied step
        self._plan: _Plan | None = None
        self.busy_s = 0.0  # time spent stepping (utilisation)

    # ------------------------------------------------------------------ queries
    def next_event_s(self) -> float | None:
        return self._plan.end_s if self._plan is not None else None

    @property
    def batch(self) -> int:
        return len(self.running)

    def adapters_in_use(self) -> set[str]:
        """The LoRA adapters holding a slot: those of the batch's decodes, of prefills it has
        started, and of colocated decodes about to join (vLLM's ``scheduled_loras``)."""
        used = {s.adapter for s in self.running.values() if s.adapter is not None}
        used.update(j.adapter for j in self.queue if j.started_s is not None and j.adapter)
        used.update(s.adapter for s in self.joining if s.admitted and s.adapter is not None)
        return used

    def waiting_for_slot(self) -> int:
        """Waiting requests whose adapter finds no free slot now (vLLM counts them under
        ``num_requests_waiting_by_reason{reason="deferred"}``)."""
        if self.max_adapters is None:
            return 0
        in_use = self.adapters_in_use()
        queued = [j.adapter for j in self.queue if j.started_s is None]
        queued += [s.adapter for s in self.joining if not s.admitted]
        return sum(self._must_wait(adapter, in_use) for adapter in queued)

    def _must_wait(self, adapter: str | None, in_use: set[str]) -> bool:
        """Whether work of ``adapter`` must wait for a slot; if it need not, its adapter
        joins ``in_use`` (it takes the slot)."""
        if adapter is None or self.max_adapters is None or adapter in in_use:
            return False
        if len(in_use) >= self.max_adapters:
            return True
        in_use.add(adapter)
        return False

    def step_time_now(self) -> float:
        return self.timing.step(self.batch, 0.0, self.context_tokens) if self.running else 0.0

    # ------------------------------------------------------------------ submissions
    def submit_prefill(self, job: PrefillJob, now: float) -> None:
        self.queue.append(job)
        self._wake(now)

    def submit_decode(self, seq: DecodeSeq, now: float) -> str | None:
        """Join the decode batch at the next step boundary, or refuse (returns the reason).

        Mooncake's baseline decode instance refuses a request whose arrival would push its
        step time past the TBT SLO, and one whose KV would not fit.
        """
        need = seq.prompt_tokens + seq.remaining
        if self.reserved_tokens + need > self.kv_capacity_tokens:
            return "kv_capacity"
        if self.decode_tbt_limit_s is not None:
            batch = self.batch + len(self.joining) + 1
            ctx = self.context_tokens + sum(s.context for s in self.joining) + seq.context
            if self.timing.step(batch, 0.0, ctx) > self.decode_tbt_limit_s:
                return "tbt_slo"
        self.reserved_tokens += need
        self.joining.append(seq)
        self._wake(now)
        return None

    def _wake(self, now: float) -> None:
        plan = self._plan
        if plan is None:
            self.clock_s = max(self.clock_s, now)
            self._replan()
        elif now <= plan.start_s:
            self._replan()  # nothing has run yet: plan again with the newcomer in
        elif plan.steps > 1:
            # Cut a decode segment at the first step boundary at or after `now`.
            ran = now - plan.start_s - plan.extra_s
            steps = self.timing.decode_steps_until(plan.batch, plan.context, ran)
            if steps < plan.steps:
                plan.steps = steps
                plan.end_s = plan.start_s + plan.extra_s
                plan.end_s += self.timing.decode_steps(plan.batch, plan.context, steps)

    # ------------------------------------------------------------------ stepping
    def _replan(self) -> None:
        t = self.clock_s
        in_use = self.adapters_in_use() if self.max_adapters is not None else set()
        waiting: deque[DecodeSeq] = deque()
        while self.joining and len(self.running) < self.max_batch:
            seq = self.joining.popleft()
            if not seq.admitted and self._must_wait(seq.adapter, in_use):
                waiting.append(seq)  # FCFS among the rest: it keeps its place
                continue
            seq.joined_s = t
            self.running[seq.request_id] = seq
            self.context_tokens += seq.context
        waiting.extend(self.joining)
        self.joining = waiting
        batch, ctx = len(self.running), self.context_tokens
        chunks, tokens, attn = self._allocate(batch, t, in_use) if self.queue else ([], 0, 0.0)
        # Loads are charged until a step that ran the adapter is applied (``advance``), so a
        # plan made again at the same instant still pays them.
        loads = 0.0
        adapters: tuple[str, ...] = ()
        if in_use:  # never in the simulator: no adapters there
            loads = sum(a not in self.cached_adapters for a in in_use) * self.adapter_load_s
            adapters = tuple(in_use)
        if chunks:
            dt = self.timing.step(tokens + batch, attn, ctx) + loads
            self._plan = _Plan(t + dt, 1, chunks, t, batch, ctx, loads, adapters)
        elif self.running:  # decodes only (queued prefills, if any, wait for a slot)
            steps = min(s.remaining for s in self.running.values())
            if self.max_segment_steps is not None:
                steps = min(steps, self.max_segment_steps)
            dt = self.timing.decode_steps(batch, ctx, steps) + loads
            self._plan = _Plan(t + dt, steps, [], t, batch, ctx, loads, adapters)
        else:
            self._plan = None

    def _allocate(
        self, batch: int, now: float, in_use: set[str]
    ) -> tuple[list[tuple[PrefillJob, int]], int, float]:
        """Prefill tokens for this step: FCFS chunks within the token budget, skipping jobs
        whose adapter finds no free slot."""
        budget = None if self.chunk_tokens is None else max(self.chunk_tokens - batch, 1)
        chunks: list[tuple[PrefillJob, int]] = []
        tokens, attn = 0, 0.0
        for job in self.queue:
            if job.started_s is None:
                if self._must_wait(job.adapter, in_use):
                    continue
                self._start(job, now)
            left = job.new_tokens - job.done
            n = left if budget is None else min(left, budget - tokens)
            if n <= 0:
                break
            chunks.append((job, n))
            attn += n * (job.cached_tokens + job.done + n / 2)
            tokens += n
            if budget is None or tokens >= budget:
                break  # unchunked engines run one prompt per step
        return chunks, tokens, attn

    def _start(self, job: PrefillJob, now: float) -> None:
        job.started_s = now
        cached = 0
        if self.cache is not None:
            cached = self.cache.match(job.block_hashes) * job.block_size
        # The engine always computes at least the last prompt token.
        job.cached_tokens = max(0, min(cached, job.prompt_tokens - 1))

    def advance(self, now: float) -> StepReport:
        """Apply the planned work that ends at ``now`` (== next_event_s()) and plan more."""
        plan = self._plan
        report = StepReport()
        if plan is None or now < plan.end_s:
            return report
        self.busy_s += plan.end_s - plan.start_s
        self.clock_s = plan.end_s
        if plan.adapters:  # read in (if they were not) and used
            use_adapters(self.cached_adapters, plan.adapters, self.max_cached_adapters)
        for job, n in plan.chunks:
            job.done += n
            if job.done >= job.new_tokens:
                self._finish_prefill(job, report)
        if plan.batch:
            self._decode_steps(plan, report)
        self._replan()
        return report

    def _finish_prefill(self, job: PrefillJob, report: StepReport) -> None:
        self.queue.remove(job)
        if self.cache is not None:
            self.cache.insert(job.block_hashes)
        assert job.started_s is not None
        report.prefilled.append(
            PrefillDone(job.request_id, job.cached_tokens, job.started_s, self.clock_s)
        )
        if self.role is Role.BOTH and job.output_tokens > 1:
            # Colocated: the first token came from the prefill; decode here from now on.
            seq = DecodeSeq(job.request_id, job.prompt_tokens, job.output_tokens - 1)
            seq.adapter, seq.admitted = job.adapter, True
            self.reserved_tokens += job.prompt_tokens + seq.remaining
            self.joining.append(seq)

    def _decode_steps(self, plan: _Plan, report: StepReport) -> None:
        steps, batch = plan.steps, plan.batch
        first = self.timing.step(batch, 0.0, plan.context)
        mean = first + self.timing.k_s * batch * (steps - 1) / 2
        if plan.chunks:  # a mixed step: decodes waited for the prefill chunk too
            mean = plan.end_s - plan.start_s
        else:
            mean += plan.extra_s / steps  # an adapter load held up the segment
        report.tbt.append((mean, steps * batch))
        done = []
        for seq in self.running.values():
            seq.generated += steps
            seq.remaining -= steps
            if seq.remaining <= 0:
                done.append(seq)
        self.context_tokens += steps * len(self.running)
        for seq in done:
            del self.running[seq.request_id]
            self.context_tokens -= seq.context
            self.reserved_tokens -= seq.prompt_tokens + seq.generated
            report.finished.append(seq)

    def drop(self, request_id: str) -> bool:
        """Abort a request wherever it is (client left, instance failure)."""
        for job in self.queue:
            if job.request_id == request_id:
                if self._plan is not None and any(j is job for j, _ in self._plan.chunks):
                    return False  # mid-step; it finishes the step, the caller ignores it
                self.queue.remove(job)
                return True
        seq = self.running.pop(request_id, None)
        if seq is None:
            for s in self.joining:
                if s.request_id == request_id:
                    self.joining.remove(s)
                    self.reserved_tokens -= s.prompt_tokens + s.remaining
                    return True
            return False
        self.context_tokens -= seq.context
        self.reserved_tokens -= seq.prompt_tokens + seq.generated + seq.remaining
        return True
