"""One ext_proc stream (one HTTP request through Envoy): its messages in, the picker's answers
out.

Request side, as Envoy's ``protocol_config`` says (its first message):
- ``FULL_DUPLEX_STREAMED`` (GIE's mode): the request-headers answer is held until the body
  has ended; then the pick goes out on it, and the body is handed back as streamed chunks.
- ``BUFFERED``: headers are answered at once, the pick rides on the body answer.
- a request without a body (end of stream on its headers) is picked from its headers.
A request that waits for decode room (the picker's ``Waiting``) first gets Envoy's message
timeout extended (``override_message_timeout``: Envoy's ``max_message_timeout`` must allow it);
``handle`` returns that alone and ``resume`` the answer once the wait ended (the server calls it
while ``waiting``).
Response side: headers get kvgate's decision headers; each body chunk is observed and passed
on (streamed back in duplex mode, a plain continue otherwise); the end closes the books. A
stream that ends before the answer did (client gone, upstream reset, Envoy's timeout) closes
them as failed: in-flight work always returns to zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.epp import protocol as pr
from gateway.epp.picker import (
    Flight,
    Immediate,
    Outcome,
    Passthrough,
    Picker,
    Settled,
    Waiting,
)

Replies = Iterator[ext.ProcessingResponse]
Answer = Callable[[Settled], list[ext.ProcessingResponse]]


class Exchange:
    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.request_mode = pr.FULL_DUPLEX
        self.response_mode = pr.STREAMED
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.outcome: Outcome | None = None
        self.response_ended = False
        self._held: tuple[Waiting, Answer] | None = None  # a pick waiting for decode room

    @property
    def flight(self) -> Flight | None:
        return self.outcome if isinstance(self.outcome, Flight) else None

    @property
    def waiting(self) -> bool:
        """The last pick waits for decode room: ``resume`` gives its answer."""
        return self._held is not None

    async def resume(self) -> list[ext.ProcessingResponse]:
        assert self._held is not None
        waiting, answer = self._held
        try:
            self.outcome = await self.picker.settle(waiting)
        finally:
            self._held = None
        return answer(self.outcome)

    async def handle(self, req: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        """The answers to one message from Envoy (none while a duplex request is held)."""
        if req.HasField("protocol_config"):
            self.request_mode = req.protocol_config.request_body_mode
            self.response_mode = req.protocol_config.response_body_mode
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(req.request_headers)
        if kind == "request_body":
            return await self._request_body(req.request_body)
        if kind == "response_headers":
            return self._response_headers(req.response_headers)
        if kind == "response_body":
            return list(self._response_body(req.response_body))
        if kind == "request_trailers":
            return await self._request_trailers()
        if kind == "response_trailers":
            self._end_response()
            return [pr.continue_trailers(request=False)]
        return []

    # ------------------------------------------------------------------ request
    async def _request_headers(self, h: ext.HttpHeaders) -> list[ext.ProcessingResponse]:
        self.headers = pr.header_map(h)
        if h.end_of_stream:  # nothing more will come: pick now
            return await self._pick(lambda outcome: [self._headers_answer(outcome)])
        if self.request_mode == pr.FULL_DUPLEX:
            return []  # held until the body has ended
        return [pr.continue_request_headers()]

    async def _request_body(self, b: ext.HttpBody) -> list[ext.ProcessingResponse]:
        self.body.append(b.body)
        self.size += len(b.body)
        too_large = self.picker.too_large(self.size)
        if too_large is not None:  # answered now: the rest of the body is not kept
            self.body, self.outcome = [], too_large
            return [pr.immediate(too_large.status, too_large.body, too_large.headers)]
        if not b.end_of_stream:
            if self.request_mode == pr.FULL_DUPLEX:
                return []
            return [pr.continue_request_body()]  # STREAMED: each chunk is answered
        return await self._pick(self._body_answer)

    def _body_answer(self, outcome: Settled) -> list[ext.ProcessingResponse]:
        if isinstance(outcome, Immediate):
            return [pr.immediate(outcome.status, outcome.body, outcome.headers)]
        endpoints, extra = _route(outcome)
        raw, extra, rewritten = self._engine_body(outcome, extra)
        if self.request_mode != pr.FULL_DUPLEX:
            return [pr.routed_body_response(endpoints, extra, raw if rewritten else None)]
        return [
            pr.routed_headers_response(endpoints, extra),
            *pr.streamed_chunks(raw, True, request=True),
        ]

    async def _request_trailers(self) -> list[ext.ProcessingResponse]:
        """Trailers end a request whose body did not say it ended: pick now (duplex)."""
        trailers = pr.continue_trailers(request=True)
        if self.outcome is not None or self.request_mode != pr.FULL_DUPLEX:
            return [trailers]

        def answer(outcome: Settled) -> list[ext.ProcessingResponse]:
            if isinstance(outcome, Immediate):
                return [pr.immediate(outcome.status, outcome.body, outcome.headers)]
            endpoints, extra = _route(outcome)
            raw, extra, _ = self._engine_body(outcome, extra)
            return [
                pr.routed_headers_response(endpoints, extra),
                *pr.streamed_chunks(raw, False, request=True),
                trailers,
            ]

        return await self._pick(answer)

    def _engine_body(
        self, outcome: Settled, extra: pr.HeaderPairs
    ) -> tuple[bytes, pr.HeaderPairs, bool]:
        """The request body for the engine (the pick's rewrite, e.g. llama.cpp's id_slot, else
        the client's), the route's headers (with the new length when rewritten) and whether it
        was; the held body is let go."""
        raw, self.body = b"".join(self.body), []
        rewritten = outcome.request_body if isinstance(outcome, Flight) else None
        if rewritten is None:
            return raw, extra, False
        return rewritten, [*extra, (b"content-length", str(len(rewritten)).encode())], True

    async def _pick(self, answer: Answer) -> list[ext.ProcessingResponse]:
        """Pick, and ``answer`` the outcome; a pick that waits answers later (``resume``),
        after Envoy was asked to wait that long."""
        raw = b"".join(self.body)
        outcome = await self.picker.pick(self.headers.get(":path", "/"), self.headers, raw)
        self.outcome = outcome
        if isinstance(outcome, Waiting):
            self._held = (outcome, answer)
            return [pr.extend_message_timeout(self.picker.envoy_wait_s(outcome))]
        return answer(outcome)

    def _headers_answer(self, outcome: Settled) -> ext.ProcessingResponse:
        if isinstance(outcome, Immediate):
            return pr.immediate(outcome.status, outcome.body, outcome.headers)
        endpoints, extra = _route(outcome)
        return pr.routed_headers_response(endpoints, extra)

    # ------------------------------------------------------------------ response
    def _response_headers(self, h: ext.HttpHeaders) -> list[ext.ProcessingResponse]:
        f = self.flight
        if f is None:
            return [pr.response_headers_reply()]
        headers = pr.header_map(h)
        status = headers.get(":status", "0")
        code = int(status) if status.isdigit() else 0
        self.picker.response_started(f, code, headers.get(pr.SERVED_HEADER))
        reply = pr.response_headers_reply(f.headers)
        if h.end_of_stream:
            self._end_response()
        return [reply]

    def _response_body(self, b: ext.HttpBody) -> Replies:
        f = self.flight
        if f is not None:
            self.picker.chunk(f, b.body)
        if self.response_mode == pr.FULL_DUPLEX:
            yield from pr.streamed_chunks(b.body, b.end_of_stream, request=False)
        else:
            yield pr.continue_response_body()
        if b.end_of_stream:
            self._end_response()

    def _end_response(self) -> None:
        self.response_ended = True
        f = self.flight
        if f is not None:
            self.picker.finished(f)

    def close(self, outcome: str = "client_disconnected") -> None:
        """The stream ended: a request still in the books did not get its whole answer."""
        f = self.flight
        if f is not None and not f.closed:
            self.picker.failed(f, outcome)


def _route(outcome: Flight | Passthrough) -> tuple[list[str], pr.HeaderPairs]:
    if isinstance(outcome, Passthrough):
        return outcome.endpoints, ()
    # x-request-id (the id kvgate keys its books with) and the trace context
    return outcome.endpoints, outcome.upstream
