"""The proxy hot path, in plain ASGI: parse -> decide -> reject at once or forward and stream.

Plain ASGI (not a Starlette endpoint) because this path runs for every request and token; the
reference measurements show Starlette's StreamingResponse costing ~2x the CPU of raw ASGI
(docs/proxy-bench.md has this gateway's own). The body is forwarded as the client sent it and
the answer streamed through chunk by chunk as it arrives, never buffered (gateway/relay.py).
With tracing off no span objects are made at all. What happens is reported back to the
Conductor: dispatched, prefill done, first token, tokens, finished, failed (including a client
that went away, which also aborts the engine legs).

Under overload a request whose best case already misses its TTFT SLO is rejected right after
its JSON is parsed, before its prompt is tokenized and hashed (``_hopeless``; the rule is in
routing/hopeless.py): most of a rejection's cost was that prompt work.

Failures: a leg that could not connect is retried once elsewhere (never on the instance that
just failed); an engine that took the request and then went silent is aborted after
``Gateway.silence_timeout`` and not retried (the time is spent): 504, or an SSE error event
once the stream had started; either way every book (Conductor, decision record, drain) is
closed. While the gateway drains (SIGTERM) new requests get 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

from backends.drivers import UpstreamError, UpstreamResponse
from backends.legs import Failure
from gateway.answers import (
    Scope,
    decision_headers,
    end_aborted,
    new_request_id,
    read_body,
    rejection_response,
    send_json,
    send_upstream_error,
    usable_request_id,
)
from gateway.batched_prompts import BatchedCompletion, batch_of_prompts
from gateway.doomed_warmups import DoomedWarmups
from gateway.forward_plan import open_legs
from gateway.learning import DecisionRecord
from gateway.openai import (
    CHAT,
    COMPLETIONS,
    BadRequest,
    ParsedRequest,
    RequestHead,
    error_body,
    head_info,
)
from gateway.proxy_deps import ProxyGateway
from gateway.relay import (
    ClientWatch,
    Receive,
    ResponseStart,
    Send,
    StreamMarks,
    relay_stream,
    send_stream_error,
    shutting_down_body,
    usage_tokens,
)
from gateway.responses_api import RESPONSES, ResponsesRoute
from gateway.responses_api import TOKEN_MARK as RESPONSES_TOKEN
from gateway.tenants import Refusal, TenantGate
from routing.types import Decision, Rejection, RejectReason, RequestInfo


class CompletionHandler:
    """Handles POST /v1/completions, /v1/chat/completions and /v1/responses for one gateway."""

    def __init__(self, gw: ProxyGateway, tenants: TenantGate | None = None) -> None:
        self.gw = gw
        self.tenants = tenants or TenantGate(gw)  # keys, rate limits, fair share (or off)
        self.warmups = DoomedWarmups(gw)  # what doomed requests' rejections leave to warm
        self.batches = BatchedCompletion(self)  # a list of prompts: one request per prompt
        # /v1/responses: its prompt and its owners (shared with the other replicas)
        self.responses = ResponsesRoute(gw.specs, gw.response_owners)
        requests = gw.metrics.requests
        self._completed = requests.labels("completed")
        self._rejected = requests.labels("rejected")
        self._upstream_error = requests.labels("upstream_error")
        self._disconnected = requests.labels("client_disconnected")

    def _count(self, outcome_counter: Any, info: RequestInfo, outcome: str) -> None:
        outcome_counter.inc()
        self.tenants.count(info.request_id, outcome)
        if info.model is not None:  # config ``models``: per-model series too
            self.gw.metrics.model_requests.labels(info.model, outcome).inc()

    async def _reject(self, send: Send, rej: Rejection, decision_s: float, info: RequestInfo):
        """A rejection's answer and metrics (the full decision's or the hopeless check's)."""
        self.gw.metrics.decision.observe(decision_s)
        self.gw.metrics.rejections.labels(rej.reason.value, rej.priority or "").inc()
        self._count(self._rejected, info, "rejected")
        await send_json(send, *rejection_response(rej, info.request_id))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        # ASGI servers lower-case header names already
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id")
        # A client's id already in flight would share its books with another request.
        usable = usable_request_id(given) and given not in gw.conductor.requests
        request_id = given if usable and given is not None else new_request_id()
        if gw.drain.draining:  # shutting down (SIGTERM): the client retries elsewhere
            await self._refuse_draining(send, request_id)
            return
        tenant = self.tenants.identify(headers)  # "" with tenants off
        if isinstance(tenant, Refusal):
            await tenant.answer(send, request_id)
            return
        path = prompt_path = scope["path"]
        exclude: frozenset[str] = frozenset()  # a Responses follow-up: all but its owner
        try:
            raw = await read_body(receive, gw.settings.server.max_body_bytes)
            head = sent = gw.parse_head(raw)
            if path == COMPLETIONS and (
                prompts := batch_of_prompts(head.body, gw.settings.server.max_batch_prompts)
            ):
                await self.batches.serve(scope, request_id, head.body, prompts, receive, send)
                return
            if path == RESPONSES:  # placed by the chat prompt the engine renders it as
                prompt_path, (head, exclude) = CHAT, self.responses.prompt(head)
            if not self.tenants.enabled and await self._hopeless(
                prompt_path, head, headers, request_id, send
            ):
                return
            await gw.tokenize_ahead(prompt_path, head)  # a long prompt: in a worker thread
            parsed = gw.parse_prompt(prompt_path, head, headers, request_id)
            parsed.body = sent.body  # what is forwarded: the client's body
        except ConnectionResetError:
            return
        except BadRequest as exc:
            gw.metrics.requests.labels("bad_request").inc()
            self.tenants.count(tenant, "bad_request")
            body = error_body(exc.message, "invalid_request_error", param=exc.param, code=exc.code)
            await send_json(send, exc.status, body, [(b"x-request-id", request_id.encode())])
            return
        if (refusal := self.tenants.admit(tenant, request_id, parsed.info, gw.clock())) is not None:
            await refusal.answer(send, request_id)
            return
        # A drain (SIGTERM) waits for this request, or aborts it. Here, not in a wrapper
        # coroutine: every suspension of the answer resumes through each frame of the chain.
        gw.drain.enter()
        try:
            if not gw.tracing.enabled:  # no span machinery at all, not even no-op spans
                await self._serve(parsed, path, raw, receive, send, exclude)
                return
            tracer = gw.tracing.tracer
            with tracer.start_as_current_span(
                "kvgate.request", context=gw.tracing.extract(headers)
            ) as span:
                span.set_attribute("kvgate.request_id", request_id)
                await self._serve(parsed, path, raw, receive, send, exclude)
        finally:
            gw.drain.leave(request_id)
            self.tenants.leave(request_id)

    async def _hopeless(
        self, path: str, head: RequestHead, headers: dict[str, str], request_id: str, send: Send
    ) -> bool:
        """Rejects the request before its prompt is tokenized and hashed when even the best
        case misses its TTFT SLO (routing/hopeless.py), as ``schedule`` would; True if it
        answered. Not with tenants on: their buckets and shares need the prompt's tokens."""
        t0, now = time.perf_counter(), self.gw.clock()
        info = head_info(path, head, headers, request_id, now, self.gw.settings)
        rej = self.gw.conductor.reject_hopeless(info, now) if info is not None else None
        if info is None or rej is None:
            return False
        await self._reject(send, rej, time.perf_counter() - t0, info)
        return True

    def _decide(
        self, parsed: ParsedRequest, exclude: frozenset[str]
    ) -> tuple[Decision | Rejection, float]:
        gw = self.gw
        if gw.tracing.enabled:
            with gw.tracing.tracer.start_as_current_span("kvgate.decision"):
                return self._decide_now(parsed, exclude)
        return self._decide_now(parsed, exclude)

    def _decide_now(
        self, parsed: ParsedRequest, exclude: frozenset[str]
    ) -> tuple[Decision | Rejection, float]:
        """The decision (booked if placed) and the seconds it took; not on ``exclude``."""
        gw = self.gw
        t0 = time.perf_counter()
        now = gw.clock()
        out = gw.conductor.schedule(parsed.info, now, exclude)
        if isinstance(out, Decision):  # a tenant over its fair share may be turned away
            out = self.tenants.screen(out, parsed.info, now)
        if isinstance(out, Decision):
            gw.conductor.dispatched(out, parsed.info, now)
        return out, time.perf_counter() - t0

    def _account(self, d: Decision, record: DecisionRecord, decision_s: float) -> None:
        """What only reports need; runs while the engine works, off the time to first token."""
        gw = self.gw
        gw.metrics.decision.observe(decision_s)
        if d.best_effort:
            gw.metrics.best_effort.inc()
        gw.learner.record(record)

    async def _refuse_draining(self, send: Send, request_id: str) -> None:
        gw = self.gw
        gw.metrics.requests.labels("shutting_down").inc()
        headers = [
            (b"retry-after", str(gw.drain.retry_after_s()).encode()),
            (b"connection", b"close"),  # the client's next try opens a connection elsewhere
            (b"x-request-id", request_id.encode()),
        ]
        await send_json(send, 503, shutting_down_body(), headers)

    async def _serve(
        self,
        parsed: ParsedRequest,
        path: str,
        raw: bytes,
        receive: Receive,
        send: Send,
        exclude: frozenset[str] = frozenset(),
    ):
        gw = self.gw
        rid = parsed.info.request_id
        retries = gw.settings.server.max_retries
        failed_on = exclude  # never there; and a retry goes elsewhere
        marks = StreamMarks(RESPONSES_TOKEN) if path == RESPONSES else None
        last_error: UpstreamError | None = None
        watch: ClientWatch | None = None  # made as the first legs open
        try:
            while True:
                decision, decision_s = self._decide(parsed, failed_on)
                if isinstance(decision, Rejection) and last_error is not None:
                    # Nowhere else to retry: the client hears what went wrong, not "no capacity".
                    self._count(self._upstream_error, parsed.info, "upstream_error")
                    await send_upstream_error(send, last_error, rid)
                    return
                if isinstance(decision, Rejection) and decision.reason is RejectReason.TBT_SLO:
                    # It may wait for decode room (gateway/decode_waits.py) instead of a 429.
                    decision = await gw.decode_waits.wait(
                        decision, parsed.info, self.tenants.screen
                    )
                if isinstance(decision, Rejection):
                    if decision.warmup is not None:  # booked now, on the view that chose it
                        self.warmups.start(decision, parsed, path)
                    await self._reject(send, decision, decision_s, parsed.info)
                    return
                await gw.replicator.before_prefill(path, parsed, decision)
                record = DecisionRecord.of(rid, gw.clock(), decision)
                asyncio.get_running_loop().call_soon(self._account, decision, record, decision_s)
                if watch is None:
                    watch = ClientWatch(receive)
                else:
                    watch.opening()
                try:
                    upstream = await open_legs(gw, parsed, path, raw, decision)
                except asyncio.CancelledError:
                    self._attempt_failed(rid, record)
                    if not watch.disconnected:  # the server gave up on it (shutdown)
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    record.outcome = "client_disconnected"
                    self._count(self._disconnected, parsed.info, "client_disconnected")
                    return
                except UpstreamError as exc:
                    self._attempt_failed(rid, record)  # this attempt's; a retry makes its own
                    if exc.status is None or exc.status >= 500:  # a 4xx: the request's fault
                        gw.legs.failed(exc.instance_id, exc.kind)
                    # Retry elsewhere while nothing reached the client, unless the engine went
                    # silent: the time the client can wait is spent.
                    if exc.status is not None or exc.kind is Failure.SILENT or retries <= 0:
                        self._count(self._upstream_error, parsed.info, "upstream_error")
                        await send_upstream_error(send, exc, rid)
                        return
                    failed: UpstreamError | None = exc
                else:
                    watch.answering(upstream)
                    if upstream.instance_id != decision.decode:  # moved by late decode binding
                        decision = replace(decision, decode=upstream.instance_id)
                        record.decode = decision.decode
                    # None: answered. Else the engine failed before any byte of its answer
                    # reached the client (e.g. killed after its response headers): as invisible
                    # to the client as a refused connection, so retried the same way.
                    failed = await self._relay(
                        parsed, upstream, decision, record, watch, send, retries > 0, marks
                    )
                    if failed is None:
                        return
                retries -= 1
                failed_on |= {failed.instance_id}
                last_error = failed
                gw.metrics.retries.inc()
        finally:
            if watch is not None:
                watch.stop()

    def _attempt_failed(self, rid: str, record: DecisionRecord) -> None:
        self.gw.unpin_slot(rid)
        self.gw.conductor.failed(rid, self.gw.clock())
        record.outcome = "failed"

    async def _relay(
        self,
        parsed: ParsedRequest,
        upstream: UpstreamResponse,
        d: Decision,
        record: DecisionRecord,
        watch: ClientWatch,
        send: Send,
        may_retry: bool = False,
        marks: StreamMarks | None = None,
    ) -> UpstreamError | None:
        """Streams the answer to the client. Returns the engine's error, with the books closed
        and nothing sent, when it failed before the client got any byte and ``may_retry``: the
        caller places the request again; else None (answered, or the failure was told).
        ``marks``: a Responses API answer (its stream's tokens; its id, learned)."""
        gw = self.gw
        rid = parsed.info.request_id
        gw.drain.streaming(rid, upstream)
        tokens = 0
        # Sent with the answer's first bytes: until then a failure is a plain error response.
        start = ResponseStart(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": [
                    (b"content-type", upstream.content_type.encode()),
                    *decision_headers(d, rid),
                ],
            }
        )
        try:
            if parsed.stream:
                tokens, tail = await relay_stream(
                    upstream, record, send, gw.conductor, gw.metrics, gw.clock, start, marks
                )
            else:
                tail = await upstream.read()
                now = gw.clock()
                record.observed_ttft_s = gw.conductor.first_token(rid, now)
                tokens = usage_tokens(tail)
                start.sent = True
                await send(start.message)
                await send({"type": "http.response.body", "body": tail})
            upstream.close()
            if marks is not None:  # which instance holds this response, for its follow-ups
                self.responses.answered(d.decode, marks.opening or tail)
            now = gw.clock()
            # The engine's answer corrects the cache view (what it had cached, what it now has).
            gw.cache_reported(rid, now, tail)
            # Counted once answered: a refused or failed attempt cached nothing.
            gw.metrics.placed(d.prompt_tokens, gw.cached_tokens(d))
            gw.conductor.finished(
                rid, now, output_tokens=tokens or None, decode_timed=parsed.stream
            )
            record.outcome = "completed"
            self._count(self._completed, parsed.info, "completed")
            self._learn(d, record)
        except (UpstreamError, OSError, asyncio.CancelledError) as exc:
            upstream.close()
            gw.conductor.failed(rid, gw.clock())
            if watch.disconnected:
                record.outcome = "client_disconnected"
                self._count(self._disconnected, parsed.info, "client_disconnected")
            elif rid in gw.drain.aborted:  # shutting down: not the engine's fault
                record.outcome = "aborted"
                gw.metrics.requests.labels("shutting_down").inc()
                await end_aborted(send, parsed.stream, start)
            else:
                record.outcome = "failed"
                if isinstance(exc, UpstreamError):
                    gw.legs.failed(exc.instance_id, exc.kind)
                    if may_retry and not start.sent and exc.kind is not Failure.SILENT:
                        return exc
                self._count(self._upstream_error, parsed.info, "upstream_error")
                if isinstance(exc, UpstreamError):
                    if start.sent:
                        await send_stream_error(send, parsed.stream, exc)
                    else:
                        await send_upstream_error(send, exc, rid)
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            gw.unpin_slot(rid)
        return None

    def _learn(self, d: Decision, rec: DecisionRecord) -> None:
        gw = self.gw
        spec = gw.specs.get(d.prefill)
        error = gw.learner.observe_answer(d, rec, spec.profile if spec else None)
        if error is not None:
            gw.metrics.ttft_error.observe(error)
