"""Deterministic discrete-event replay of a trace through kvgate's Conductor and engine models.

No sockets, no sleeping: a heap of events ordered by (time, kind, sequence number). At equal
times the documented tie-break is: engine step completions first (freed capacity is visible),
then transfer completions, then arrivals, then load samples; within a kind, the order in which
events were scheduled. Randomness comes only from seeded generators (the Conductor's policy
RNG), so the same inputs give the same result.

The Conductor is driven through the same event API the live gateway uses: schedule,
dispatched, first_token (prefill done), tokens, finished, failed, kv_event, replication_done.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum

from backends.predictor_files import predictor_factory
from config.settings import Role, Settings
from predictors.profiles import get_profile
from replay.engine.engine import DecodeSeq, Engine, PrefillJob, StepReport
from replay.engine.network import NETWORK_MODELS
from replay.report.results import LoadSample, Outcome, RequestOutcome, RunResult
from replay.sim.admission_counters import admission_counters
from replay.sim.fleet import FleetSpec, build_engines, fleet_settings
from replay.sim.options import SimOptions
from replay.workload.traces import TraceRequest
from routing.conductor import Conductor
from routing.hashing import hash_ids_to_blocks
from routing.types import Decision, Rejection, ReplicationCommand, RequestInfo


class _Kind(IntEnum):  # the tie-break order at equal times
    ENGINE = 0
    PULL_DONE = 1
    COPY_DONE = 2
    KV_ARRIVED = 3
    ARRIVAL = 4
    SAMPLE = 5


@dataclass(slots=True)
class _InFlight:
    kind: _Kind  # the event its arrival is
    payload: object
    version: int = 0  # of its latest scheduled end; earlier events for it are stale


Progress = Callable[[int, int], None]  # (requests arrived so far, total)


class Simulator:
    def __init__(
        self,
        settings: Settings,
        fleet: FleetSpec,
        trace: Sequence[TraceRequest],
        options: SimOptions | None = None,
    ) -> None:
        self.settings = fleet_settings(settings, fleet)
        self.fleet = fleet
        self.trace = list(trace)
        self.options = options or SimOptions()
        # predictors.prefill_model_file, if set, is read here (the edge), not by the core.
        self.conductor = Conductor(self.settings, predictor_factory(self.settings.predictors))
        self.engines: dict[str, Engine] = build_engines(self.settings, fleet)
        profile = get_profile(fleet.profile)
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        links = NETWORK_MODELS[self.options.network]
        self.network = links(self.settings.predictors.link_bandwidth_gbps * 1e9 / 8)
        self._flows: dict[int, _InFlight] = {}  # transfers in flight, by flow number
        # Pulls in flight -> the requests whose prefill waits for them (Decision.waits_for),
        # and each waiting request's pulls still to land.
        self._held: dict[str, list[str]] = {}
        self._waiting: dict[str, set[str]] = {}
        self._flow_seq = 0
        self.block_size = self.settings.routing.block_size
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._version: dict[str, int] = dict.fromkeys(self.engines, 0)
        self.outcomes: dict[str, RequestOutcome] = {}
        self._requests: dict[str, RequestInfo] = {}
        self._decisions: dict[str, Decision] = {}
        # When each request's decoding started: TBT counts decode steps only, since Mooncake
        # overlaps the KV transfer with the prefill layer by layer (TTFT ends at prefill).
        self._decode_start_s: dict[str, float] = {}
        self._output: dict[str, int] = {}  # tokens each request will really generate
        adm = self.settings.admission.mode.value
        self.result = RunResult(
            label=self.options.label or f"{self.settings.routing.policy}+{adm}",
            policy=self.settings.routing.policy,
            admission=adm,
            ttft_slo_s=self.settings.slo.ttft_s,
            tbt_slo_s=self.settings.slo.tbt_s,
            duration_s=(self.trace[-1].arrival_s - self.trace[0].arrival_s) if self.trace else 0,
        )

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: _Kind, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, payload))

    def _wake(self, engine: Engine) -> None:
        """(Re)schedule the engine's next step completion; older ones become stale."""
        t = engine.next_event_s()
        self._version[engine.id] += 1
        if t is not None:
            self._push(t, _Kind.ENGINE, (engine.id, self._version[engine.id]))

    def run(self, progress: Progress | None = None) -> RunResult:
        for tr in self.trace:
            self._push(tr.arrival_s, _Kind.ARRIVAL, tr)
        if self.trace:
            self._push(self.trace[0].arrival_s, _Kind.SAMPLE, None)
        total, arrived = len(self.trace), 0
        handlers = {
            _Kind.ENGINE: self._on_engine,
            _Kind.PULL_DONE: self._on_transfer_done,
            _Kind.COPY_DONE: self._on_transfer_done,
            _Kind.KV_ARRIVED: self._on_transfer_done,
        }
        heap = self._heap
        while heap:
            now, kind, _, payload = heapq.heappop(heap)
            if kind is _Kind.ARRIVAL:
                self._on_arrival(payload, now)  # type: ignore[arg-type]
                arrived += 1
                if progress is not None and (arrived % 256 == 0 or arrived == total):
                    progress(arrived, total)
            elif kind is _Kind.SAMPLE:
                self._on_sample(now)
            else:
                handlers[kind](payload, now)
        self.result.requests = [self.outcomes[f"r{tr.index}"] for tr in self.trace]
        self.result.transferred_bytes = self.network.bytes_moved - self.result.kv_transfer_bytes
        self.result.extra["cache_capacity_blocks"] = next(
            (e.cache.capacity_blocks for e in self.engines.values() if e.cache is not None), 0
        )
        self.result.extra.update(admission_counters(self.conductor))
        return self.result

    # ------------------------------------------------------------------ arrivals
    def _on_arrival(self, tr: TraceRequest, now: float) -> None:
        rid = f"r{tr.index}"
        blocks = hash_ids_to_blocks(tr.hash_ids)
        req = RequestInfo(
            request_id=rid,
            prompt_tokens=tr.input_length,
            block_hashes=blocks,
            max_tokens=max(tr.output_length, self.options.max_tokens),
            arrival_s=now,
            output_key=blocks[0] if blocks else None,
        )
        out = RequestOutcome(rid, now, tr.input_length, tr.output_length)
        self.outcomes[rid] = out
        self._output[rid] = max(tr.output_length, 1)
        decision = self.conductor.schedule(req, now)
        if not isinstance(decision, Decision):
            # Final unless it waits for decode room and a finished decode admits it.
            out.outcome, out.reason = Outcome.REJECTED, decision.reason.value
            if decision.warmup is not None:
                self._warm(decision, req, now)
            self.conductor.park(decision, req, now)
            return
        self._dispatch(req, decision, now)

    def _release_parked(self, now: float) -> None:
        """A decode finished: the decode queue may admit one waiting request."""
        self.conductor.expire_parked(now)  # their outcome stays the rejection
        released = self.conductor.release_parked(now)
        if released is not None:
            req, decision = released
            self.outcomes[req.request_id].outcome = Outcome.FAILED  # in flight again
            self.outcomes[req.request_id].reason = ""
            self._dispatch(req, decision, now)

    def _dispatch(self, req: RequestInfo, decision: Decision, now: float) -> None:
        rid = req.request_id
        out = self.outcomes[rid]
        self.conductor.dispatched(decision, req, now)
        self._requests[rid], self._decisions[rid] = req, decision
        out.prefill_instance, out.decode_instance = decision.prefill, decision.decode
        if (
            decision.prefill == decision.decode
            and self.engines[decision.decode].role is Role.DECODE
        ):
            self.result.extra["local_prefills"] = self.result.extra.get("local_prefills", 0) + 1
        out.predicted_ttft_s = decision.predicted_ttft_s
        out.predicted_tbt_s = decision.predicted_tbt_s
        out.predicted_output_tokens = decision.predicted_output_tokens
        out.best_effort = decision.best_effort
        pull = None
        for cmd in decision.replications:
            if cmd.request_id == rid:
                pull = cmd
            else:
                self._start_copy(cmd, now)
        waits = [c for c in decision.waits_for if c in self._held]
        if pull is not None:
            nbytes = pull.tokens * self.kv_bytes_per_token
            out.transferred_bytes = nbytes
            self._held[pull.command_id] = []
            waits.insert(0, pull.command_id)
            self._transfer(_Kind.PULL_DONE, pull, pull.source, pull.destination, nbytes, now)
        if waits:  # the prefill starts when the pulls it counts on have landed
            self._waiting[rid] = set(waits)
            for cid in waits:
                self._held[cid].append(rid)
        else:
            self._submit_prefill(rid, now)

    def _warm(self, rejection: Rejection, req: RequestInfo, now: float) -> None:
        """A doomed request's warm-up (routing/doomed_warmup.py): its prompt prefilled, one
        token, no decode; followed like a request, never reported as one."""
        warm = self.conductor.dispatched_warmup(rejection, req, now)
        if warm is None:
            return
        wid = warm.request_id
        self._requests[wid], self._decisions[wid] = warm, rejection.warmup  # type: ignore[assignment]
        self._output[wid] = 1
        self.outcomes[wid] = RequestOutcome(wid, now, warm.prompt_tokens, 1)
        self._submit_prefill(wid, now)

    def _submit_prefill(self, rid: str, now: float) -> None:
        req, decision = self._requests[rid], self._decisions[rid]
        engine = self.engines[decision.prefill]
        engine.submit_prefill(
            PrefillJob(
                rid, req.block_hashes, req.prompt_tokens, self._output[rid], self.block_size
            ),
            now,
        )
        self._wake(engine)

    # ------------------------------------------------------------------ transfers
    def _transfer(
        self, kind: _Kind, payload: object, source: str, dest: str, nbytes: float, now: float
    ) -> None:
        self._flow_seq += 1
        self._flows[self._flow_seq] = _InFlight(kind, payload)
        self._schedule(self.network.start(self._flow_seq, source, dest, nbytes, now))

    def _schedule(self, ends: list[tuple[int, float]]) -> None:
        """(Re)schedule the transfers whose end is new or moved; older events become stale."""
        for flow, end in ends:
            entry = self._flows[flow]
            entry.version += 1
            self._push(end, entry.kind, (flow, entry.version))

    def _on_transfer_done(self, payload: tuple[int, int], now: float) -> None:
        flow, version = payload
        entry = self._flows.get(flow)
        if entry is None or entry.version != version:
            return  # its end moved: a later event stands for it
        del self._flows[flow]
        self._schedule(self.network.finish(flow, now))
        kind, what = entry.kind, entry.payload
        if kind is _Kind.PULL_DONE:
            self._on_pull_done(what, now)  # type: ignore[arg-type]
        elif kind is _Kind.COPY_DONE:
            self._land_copy(what, now)  # type: ignore[arg-type]
        else:
            self._on_kv_arrived(what, now)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ copies
    def _start_copy(self, cmd: ReplicationCommand, now: float) -> None:
        nbytes = cmd.tokens * self.kv_bytes_per_token
        self.result.replication_commands += 1
        self.result.replicated_bytes += nbytes
        self._transfer(_Kind.COPY_DONE, cmd, cmd.source, cmd.destination, nbytes, now)

    def _land_copy(self, cmd: ReplicationCommand, now: float) -> None:
        engine = self.engines.get(cmd.destination)
        if engine is not None and engine.cache is not None:
            engine.cache.insert(cmd.block_hashes)
            self._flush_kv_events(engine, now)
        self.conductor.replication_done(cmd.command_id, True, now)

    def _on_pull_done(self, cmd: ReplicationCommand, now: float) -> None:
        self.result.replication_commands += 1
        self.result.replicated_bytes += cmd.tokens * self.kv_bytes_per_token
        self._land_copy(cmd, now)
        for held in self._held.pop(cmd.command_id):  # its own request first, then the others
            left = self._waiting[held]
            left.discard(cmd.command_id)
            if not left:
                del self._waiting[held]
                self._submit_prefill(held, now)

    # ------------------------------------------------------------------ engines
    def _flush_kv_events(self, engine: Engine, now: float) -> None:
        if engine.cache is not None:
            for ev in engine.cache.drain_events():
                self.conductor.kv_event(engine.id, ev, now)

    def _on_engine(self, payload: tuple[str, int], now: float) -> None:
        iid, version = payload
        if version != self._version[iid]:
            return  # superseded by a later plan
        engine = self.engines[iid]
        report = engine.advance(now)
        self._flush_kv_events(engine, now)
        self._apply(engine, report, now)
        self._wake(engine)

    def _apply(self, engine: Engine, report: StepReport, now: float) -> None:
        if report.tbt:
            self.result.tbt_steps.extend(report.tbt)
        rebind = self.conductor.settings.routing.decode_rebind
        for done in report.prefilled:
            rid = done.request_id
            out = self.outcomes[rid]
            if rebind and (moved := self.conductor.rebind_decode(rid, now)) is not None:
                # The KV has not left yet: it goes to the instance that can take it.
                self._decisions[rid] = replace(self._decisions[rid], decode=moved)
                out.decode_instance = moved
            out.cached_tokens = done.cached_tokens
            out.ttft_s = now - out.arrival_s  # the prefill produces the first token ...
            self._decode_start_s[rid] = now  # colocated engines decode from here on
            self.conductor.first_token(rid, now)
            req = self._requests[rid]
            decode_id = self._decisions[rid].decode
            if self._output[rid] <= 1:
                self._complete(rid, 1, now)
            elif decode_id != engine.id:
                nbytes = req.prompt_tokens * self.kv_bytes_per_token
                self.result.kv_transfer_bytes += nbytes
                self._transfer(_Kind.KV_ARRIVED, rid, engine.id, decode_id, nbytes, now)
            elif engine.role is Role.DECODE:  # conditional disagg: prefilled where it decodes
                self._on_kv_arrived(rid, now)
        for seq in report.finished:
            self._complete(seq.request_id, seq.generated + 1, now, seq.joined_s)

    def _on_kv_arrived(self, rid: str, now: float) -> None:
        req = self._requests[rid]
        engine = self.engines[self._decisions[rid].decode]
        refused = engine.submit_decode(
            DecodeSeq(rid, req.prompt_tokens, self._output[rid] - 1), now
        )
        if refused is not None:
            out = self.outcomes[rid]
            out.outcome, out.reason = Outcome.REJECTED_AFTER_PREFILL, refused
            self.conductor.failed(rid, now, decode_refused=refused == "tbt_slo")
            self._forget(rid)
            return
        self._decode_start_s[rid] = now
        self._wake(engine)

    def _complete(
        self, rid: str, generated: int, now: float, joined_s: float | None = None
    ) -> None:
        out = self.outcomes[rid]
        out.outcome, out.finish_s, out.generated = Outcome.COMPLETED, now, generated
        start = self._decode_start_s.get(rid)
        if self.options.ttft_after_transfer and joined_s is not None:
            # ... or the decode streams it once its batch takes the request in.
            out.ttft_s = joined_s - out.arrival_s
            start = joined_s
        if start is not None and generated > 1:
            out.tbt_mean_s = (now - start) / (generated - 1)
        self.conductor.finished(rid, now, output_tokens=generated, tbt_s=out.tbt_mean_s)
        self._forget(rid)
        self._release_parked(now)

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._decisions.pop(rid, None)
        self._decode_start_s.pop(rid, None)
        self._output.pop(rid, None)

    # ------------------------------------------------------------------ sampling
    def _on_sample(self, now: float) -> None:
        for engine in self.engines.values():
            inst = self.conductor.instances[engine.id]
            # Token progress reaches the Conductor's books in batches (one call per sequence
            # per sample), the way a gateway would learn it from streamed chunks.
            for seq in engine.running.values():
                if seq.generated > seq.reported:
                    self.conductor.tokens(seq.request_id, seq.generated - seq.reported, now)
                    seq.reported = seq.generated
            self.result.load.append(
                LoadSample(
                    now,
                    engine.id,
                    engine.role.value,
                    len(engine.queue),
                    inst.queue_time(now) if engine.role is not Role.DECODE else 0.0,
                    engine.batch,
                    engine.step_time_now(),
                )
            )
        if self._heap:  # keep sampling while anything is left to happen
            self._push(now + self.options.sample_interval_s, _Kind.SAMPLE, None)
