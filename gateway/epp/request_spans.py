"""The spans of requests the endpoint picker routes (tracing on, ``server.tracing``): one
``kvgate.request`` span per request, from the pick to the end of its answer, a child of the
client's W3C trace context, with a ``kvgate.decision`` child; and the trace context Envoy sets
on the request to the engine. With tracing off nothing is made."""

from __future__ import annotations

from opentelemetry.trace import Span, set_span_in_context

from gateway.tracing import Tracing

Pairs = list[tuple[bytes, bytes]]


class RequestSpans:
    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing
        self._open: dict[str, Span] = {}  # request id -> its kvgate.request span

    def start(self, rid: str, headers: dict[str, str]) -> Span | None:
        """The request's span (kept until ``end``) and its decision's, returned to be ended
        once decided; None with tracing off."""
        tracing = self.tracing
        if not tracing.enabled:
            return None
        span = tracing.tracer.start_span("kvgate.request", context=tracing.extract(headers))
        span.set_attribute("kvgate.request_id", rid)
        self._open[rid] = span
        return tracing.tracer.start_span("kvgate.decision", context=set_span_in_context(span))

    def placed(self, rid: str, prefill: str) -> Pairs:
        """The placed request's trace-context headers for the engine (none with tracing off)."""
        span = self._open.get(rid)
        if span is None:
            return []
        span.set_attribute("kvgate.prefill", prefill)
        return [(k.encode(), v.encode()) for k, v in self.tracing.headers_for(span).items()]

    def end(self, rid: str, outcome: str) -> None:
        span = self._open.pop(rid, None)
        if span is not None:
            span.set_attribute("kvgate.outcome", outcome)
            span.end()
