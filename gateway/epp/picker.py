"""One request's pick through Envoy, and its books: the same Gateway and Conductor as
`kvgate serve` (gateway/proxy.py), with Envoy carrying the bytes.

``Picker.pick`` parses the request as `kvgate serve` does (gateway/openai.py), asks the
Conductor (``schedule`` then ``dispatched``: the same two calls as the proxy's decision), runs
the decision's replications, and answers with the engine's ``ip:port`` (then fallbacks:
other eligible instances of the same model, least queued first) or with the same rejection
body and headers as `kvgate serve` (gateway/answers.py). The ``Flight`` it returns keeps
the books from what Envoy shows of the answer: its first body chunk is the observed TTFT,
SSE ``data:`` lines count tokens, usage and cache reports come from the answer's last
chunks, and the end (or the stream breaking off) closes the books.

A request turned away on its TBT check may wait for decode room as under `kvgate serve`
(gateway/decode_waits.py): ``pick`` then returns ``Waiting``, the exchange asks Envoy to
extend its message timeout for that long (``envoy_wait_s``), and ``settle`` gives the outcome
once a finished decode admitted it or its wait ended (its 429 then).

With tracing on (``server.tracing``) a ``kvgate.request`` span runs from the pick to the end
of the answer (a child of the client's W3C trace context), with a ``kvgate.decision`` child;
the engine gets the request's traceparent through Envoy.

Tenants (gateway/tenants.py) as under `kvgate serve`: API keys (401/403), rate limits (429)
and the fair-share screen of a decision before it is booked, also for a waiting request.

P/D pools: the request goes to its decode instance's sidecar (``sidecar_url``) with the
prefill engine in ``x-prefiller-host-port`` (llm-d's protocol; gateway/epp/pd_sidecar.py runs
the legs). A llama.cpp instance's request is pinned to the slot holding its prefix as under
`kvgate serve` (routing/llamacpp_slots.py): the flight carries the body rewritten with
``id_slot``, which the exchange hands Envoy instead of the client's. Not supported here
(docs/epp.md): retries on another engine after the answer started.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from backends import json_codec
from backends.legs import Failure
from gateway.answers import (
    decision_headers,
    new_request_id,
    rejection_response,
    usable_request_id,
)
from gateway.decode_waits import Held
from gateway.doomed_warmups import DoomedWarmups
from gateway.epp.engine_addresses import EngineAddresses
from gateway.epp.pd_sidecar import PREFILLER_HEADER
from gateway.epp.protocol import MessageTimeouts
from gateway.epp.request_spans import RequestSpans
from gateway.learning import DecisionRecord
from gateway.openai import CHAT, COMPLETIONS, BadRequest, ParsedRequest, error_body
from gateway.relay import (
    StreamMarks,
    observe_gaps,
    shutting_down_body,
    usage_tokens,
)
from gateway.responses_api import RESPONSES, ResponsesRoute
from gateway.responses_api import TOKEN_MARK as RESPONSES_TOKEN
from gateway.runtime import Gateway
from gateway.tenants import Refusal, TenantGate
from routing.fleet_pools import least_loaded
from routing.prompt import TOKEN_EVENT, TOKEN_EVENT_SPACED
from routing.types import Decision, Rejection, RejectReason

Pairs = list[tuple[bytes, bytes]]
_PLACED_PATHS = (COMPLETIONS, CHAT, RESPONSES)
_TOKEN_FLUSH = 16  # as gateway/relay.py: streamed tokens reach the books in batches
_KEEP_BODY = 1 << 20  # a non-streamed answer is kept up to this for its usage (else its tail)


@dataclass(frozen=True, slots=True)
class Immediate:
    """An answer Envoy sends the client itself."""

    status: int
    body: bytes
    headers: Pairs


@dataclass(slots=True)
class Flight:
    """A placed request, from the pick to the end of its answer."""

    parsed: ParsedRequest
    decision: Decision
    record: DecisionRecord
    endpoints: list[str]
    headers: Pairs  # set on the answer (x-request-id first, then the decision's)
    upstream: Pairs  # set on the request to the engine: x-request-id (+ trace context)
    status: int = 0
    served: str | None = None  # the endpoint that served, as the proxy reported it
    rebooked: bool = False  # served by a fallback, and the books moved there
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0
    reported: int = 0
    body: list[bytes] = field(default_factory=list)  # the answer (non-streamed) or its tail
    # The request body for the engine when the pick rewrote it (llama.cpp's id_slot), else None
    request_body: bytes | None = None
    kept: int = 0
    closed: bool = False
    marks: StreamMarks | None = None  # a Responses API answer (gateway/responses_api.py)
    first_token_at: float | None = None  # when its first token reached the books

    @property
    def request_id(self) -> str:
        return self.parsed.info.request_id


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Not a completion (e.g. GET /v1/models): any eligible engine, no books."""

    endpoints: list[str]


@dataclass(frozen=True, slots=True)
class Waiting:
    """Turned away on its TBT check, held in the decode queue: ``Picker.settle`` gives its
    outcome."""

    parsed: ParsedRequest
    path: str
    held: Held


Settled = Flight | Immediate | Passthrough  # what the exchange answers Envoy with
Outcome = Settled | Waiting


class Picker:
    """The pick and the books of every request Envoy sends, for one Gateway."""

    def __init__(
        self, gw: Gateway, fallbacks: int = 1, timeouts: MessageTimeouts | None = None
    ) -> None:
        self.gw = gw
        self.addresses = EngineAddresses(gw, fallbacks)  # engines as Envoy names them
        self.timeouts = timeouts or MessageTimeouts()  # Envoy's: a wait keeps inside them
        self.warmups = DoomedWarmups(gw)  # what doomed requests' rejections leave to warm
        self.tenants = TenantGate(gw)  # keys, rate limits, fair share (or off)
        self.spans = RequestSpans(gw.tracing)  # with tracing on
        # /v1/responses: its prompt and its owners (shared with the other replicas)
        self.responses = ResponsesRoute(gw.specs, gw.response_owners)

    # ------------------------------------------------------------------ the pick
    def too_large(self, size: int) -> Immediate | None:
        """413, as `kvgate serve` answers, once the body grows past ``server.max_body_bytes``."""
        limit = self.gw.settings.server.max_body_bytes
        if size <= limit:
            return None
        self.gw.metrics.requests.labels("bad_request").inc()
        msg = f"request body larger than {limit} bytes"
        return Immediate(413, error_body(msg, "invalid_request_error"), [])

    def passthrough(self) -> Outcome:
        now = self.gw.clock()
        live = (i for i in self.gw.conductor.instances.values() if i.eligible)
        best = least_loaded(live, now)
        if best is None:
            body = error_body("no healthy engine", "service_unavailable", code="no_healthy")
            return Immediate(503, body, [(b"retry-after", b"1")])
        return Passthrough([self.addresses.of(best.id)])

    async def pick(self, path: str, headers: dict[str, str], raw: bytes) -> Outcome:
        """``headers``: lower-case names. Envoy sets x-request-id; it keys the books unless
        already in flight or unusable (then kvgate's own id replaces it upstream)."""
        gw = self.gw
        path = path.split("?", 1)[0]
        if path not in _PLACED_PATHS:
            return self.passthrough()
        given = headers.get("x-request-id")
        usable = usable_request_id(given) and given not in gw.conductor.requests
        rid = given if usable and given is not None else new_request_id()
        rid_header = (b"x-request-id", rid.encode())
        if gw.drain.draining:
            gw.metrics.requests.labels("shutting_down").inc()
            retry = str(gw.drain.retry_after_s()).encode()
            return Immediate(503, shutting_down_body(), [(b"retry-after", retry), rid_header])
        tenant = self.tenants.identify(headers)  # "" with tenants off
        if isinstance(tenant, Refusal):
            return Immediate(tenant.status, tenant.body, [*tenant.headers, rid_header])
        exclude: frozenset[str] = frozenset()  # a Responses follow-up: all but its owner
        try:
            if path == RESPONSES:
                parsed, exclude = await self.responses.parse(gw, raw, headers, rid)
            else:
                parsed = await gw.parse(path, raw, headers, rid)
        except BadRequest as exc:
            gw.metrics.requests.labels("bad_request").inc()
            self.tenants.count(tenant, "bad_request")
            body = error_body(exc.message, "invalid_request_error", param=exc.param, code=exc.code)
            return Immediate(exc.status, body, [rid_header])
        if (refusal := self.tenants.admit(tenant, rid, parsed.info, gw.clock())) is not None:
            return Immediate(refusal.status, refusal.body, [*refusal.headers, rid_header])
        decision_span = self.spans.start(rid, headers)
        t0 = time.perf_counter()
        now = gw.clock()
        decision = gw.conductor.schedule(parsed.info, now, exclude)
        if isinstance(decision, Decision):  # a tenant over its fair share may be turned away
            decision = self.tenants.screen(decision, parsed.info, now)
        if isinstance(decision, Decision):
            gw.conductor.dispatched(decision, parsed.info, now)
        gw.metrics.decision.observe(time.perf_counter() - t0)
        if decision_span is not None:
            decision_span.end()
        if (
            isinstance(decision, Rejection)
            and decision.reason is RejectReason.TBT_SLO
            and self.timeouts.max_wait_s > 0
            and not exclude  # a wait's release may place it anywhere
        ):
            # It may wait for decode room (gateway/decode_waits.py) instead of a 429 now.
            held = gw.decode_waits.hold(decision, parsed.info, self.tenants.screen)
            if held is not None:
                held = replace(held, timeout_s=min(held.timeout_s, self.timeouts.max_wait_s))
                return Waiting(parsed, path, held)
        return await self._answer(parsed, path, decision)

    def envoy_wait_s(self, w: Waiting) -> float:
        """The message timeout to ask Envoy for while ``w`` waits: its wait, then the pick."""
        return w.held.timeout_s + self.timeouts.message_s

    async def settle(self, w: Waiting) -> Flight | Immediate:
        """``w``'s outcome once its wait ended: placed (booked by the release), or its 429."""
        try:
            decision = await self.gw.decode_waits.settle(w.held)
        except BaseException:  # the stream ended while it waited (client gone)
            self.tenants.leave(w.parsed.info.request_id)
            self.spans.end(w.parsed.info.request_id, "client_disconnected")
            raise
        return await self._answer(w.parsed, w.path, decision)

    async def _answer(
        self, parsed: ParsedRequest, path: str, decision: Decision | Rejection
    ) -> Flight | Immediate:
        """The rejection's answer, or the booked decision's flight."""
        gw, rid = self.gw, parsed.info.request_id
        if isinstance(decision, Rejection):
            if decision.warmup is not None:  # the gateway sends it itself, not through Envoy
                self.warmups.start(decision, parsed, path)
            gw.metrics.rejections.labels(decision.reason.value, decision.priority or "").inc()
            self._count(parsed, "rejected")
            self.tenants.leave(rid)
            self.spans.end(rid, "rejected")
            return Immediate(*rejection_response(decision, rid))
        gw.drain.enter()  # left when the books close (Flight's end)
        try:
            await self.gw.replicator.before_prefill(path, parsed, decision)
            record = DecisionRecord.of(rid, gw.clock(), decision)
            addresses = self.addresses
            endpoints = addresses.for_pick(decision.prefill, decision.decode, parsed.info.model)
            prefiller = (
                [(PREFILLER_HEADER, addresses.of(decision.prefill))]
                if decision.prefill != decision.decode
                else []
            )  # P/D: the decode instance's sidecar runs the prefill there (pd_sidecar.py)
        except BaseException:  # e.g. an engine name that no longer resolves, or cancelled
            gw.conductor.failed(rid, gw.clock())
            gw.drain.leave(rid)
            self.tenants.leave(rid)
            self.spans.end(rid, "failed")
            raise
        gw.learner.record(record)
        if decision.best_effort:
            gw.metrics.best_effort.inc()
        answer = decision_headers(decision, rid)
        # x-request-id (the id kvgate keys its books with) and the trace context
        upstream = [*answer[:1], *self.spans.placed(rid, decision.prefill), *prefiller]
        flight = Flight(parsed, decision, record, endpoints, answer, upstream)
        if path == RESPONSES:
            flight.marks = StreamMarks(RESPONSES_TOKEN)
        slot = (
            gw.pin_slot(rid, decision.prefill, parsed.info.block_hashes) if not prefiller else None
        )
        if slot is not None:  # llama.cpp: wait for the slot that holds the prefix
            flight.request_body = json_codec.dumps({**parsed.body, "id_slot": slot})
        return flight

    def _count(self, parsed: ParsedRequest, outcome: str) -> None:
        self.gw.metrics.requests.labels(outcome).inc()
        self.tenants.count(parsed.info.request_id, outcome)
        if parsed.info.model is not None:
            self.gw.metrics.model_requests.labels(parsed.info.model, outcome).inc()

    # ------------------------------------------------------------------ the answer
    def response_started(self, f: Flight, status: int, served: str | None = None) -> None:
        """The answer's status, and the endpoint that served it if the proxy says: another
        than the pick means Envoy could not reach the pick and used a fallback, so the pick
        counts a failed leg (its health is probed now, as `kvgate serve` does) and the books
        follow the request to the fallback (``Conductor.rebook``)."""
        f.status, f.served = status, served
        if served and served != f.endpoints[0]:
            gw = self.gw
            gw.metrics.retries.inc()
            gw.legs.failed(f.decision.decode, Failure.CONNECT)  # where Envoy sent it
            iid = self.addresses.instance_at(served)
            moved = gw.conductor.rebook(f.request_id, iid, gw.clock()) if iid else None
            if moved is not None:
                f.decision, f.rebooked = moved, True
                f.record.prefill, f.record.decode = moved.prefill, moved.decode
                f.record.reason = moved.reason

    def chunk(self, f: Flight, data: bytes) -> None:
        """One body chunk of the answer as Envoy passes it on."""
        if f.closed or f.status >= 400 or not data:
            return
        gw = self.gw
        now = gw.clock()
        marks = f.marks
        if f.first_token_at is None and (
            marks is None or not f.parsed.stream or marks.token in data
        ):  # (a Responses stream's first token is its first delta event, not its first chunk)
            f.first_token_at = now
            f.record.observed_ttft_s = gw.conductor.first_token(f.request_id, now)
            if f.record.observed_ttft_s is not None:
                gw.metrics.ttft.observe(f.record.observed_ttft_s)
        if marks is not None and not f.stamps:
            marks.opening = data
        f.stamps.append(now)
        if f.parsed.stream:
            if marks is None:
                f.tokens += data.count(TOKEN_EVENT) or data.count(TOKEN_EVENT_SPACED)
            else:
                f.tokens += data.count(marks.token)
            if f.tokens - f.reported >= _TOKEN_FLUSH:
                gw.conductor.tokens(f.request_id, f.tokens - f.reported, now)
                f.reported = f.tokens
            f.body = [*f.body[-1:], data]  # the last two chunks: where a usage chunk is
        elif f.kept + len(data) <= _KEEP_BODY:
            f.body.append(data)
            f.kept += len(data)
        else:
            f.body = [*f.body[-1:], data]

    def finished(self, f: Flight) -> None:
        """The answer ended (Envoy's end of stream on the response body)."""
        if f.closed:
            return
        gw = self.gw
        if f.status >= 400:  # the engine's own error (or Envoy's, e.g. no upstream)
            self.failed(f, "upstream_error")
            return
        now = gw.clock()
        if f.first_token_at is None:  # an answer without a token still answered
            f.record.observed_ttft_s = gw.conductor.first_token(f.request_id, now)
        tail = b"".join(f.body)
        # A stream's own usage where it ends with one (an event may carry several tokens).
        tokens = (usage_tokens(tail) or f.tokens) if f.parsed.stream else usage_tokens(tail)
        if f.marks is not None:  # which instance holds this response, for its follow-ups
            self.responses.answered(f.decision.decode, f.marks.opening or tail)
        if f.parsed.stream and f.first_token_at is not None and tokens > 1:
            f.record.observed_tbt_s = (f.stamps[-1] - f.first_token_at) / (tokens - 1)
        observe_gaps(gw.metrics.tbt, f.stamps)
        d, rid = f.decision, f.request_id
        gw.cache_reported(rid, now, tail)
        gw.metrics.placed(d.prompt_tokens, d.cached_tokens)
        gw.conductor.finished(rid, now, output_tokens=tokens or None, decode_timed=f.parsed.stream)
        direct = f.served in (None, f.endpoints[0])
        if direct or f.rebooked:  # d.prefill answered
            gw.legs.succeeded(d.prefill)
        f.record.outcome = "completed"
        self._count(f.parsed, "completed")
        if direct:  # a fallback's TTFT includes the failed try at the pick: nothing to learn
            self._learn(f)
        self._close(f)

    def failed(self, f: Flight, outcome: str) -> None:
        """The answer failed or the stream broke off: the books close without learning.
        ``upstream_error`` with a 5xx (or no answer at all) counts against the engine."""
        if f.closed:
            return
        gw = self.gw
        gw.conductor.failed(f.request_id, gw.clock())
        f.record.outcome = "failed" if outcome == "upstream_error" else outcome
        if outcome == "upstream_error" and (f.status == 0 or f.status >= 500):
            kind = Failure.HTTP if f.status else Failure.CONNECT
            gw.legs.failed(f.decision.prefill, kind)
        self._count(f.parsed, outcome)
        self._close(f)

    def _close(self, f: Flight) -> None:
        f.closed = True
        f.body = []
        self.gw.unpin_slot(f.request_id)
        self.gw.drain.leave(f.request_id)
        self.tenants.leave(f.request_id)
        self.spans.end(f.request_id, f.record.outcome or "failed")

    def _learn(self, f: Flight) -> None:
        gw, d = self.gw, f.decision
        spec = gw.specs.get(d.prefill)
        error = gw.learner.observe_answer(d, f.record, spec.profile if spec else None)
        if error is not None:
            gw.metrics.ttft_error.observe(error)
