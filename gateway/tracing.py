"""OpenTelemetry tracing: a span per request, child spans for the decision and the legs, and
W3C trace context sent to the engines. Exporter: off (no-op tracer), console, or OTLP/HTTP."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from config.settings import ServerSettings, TracingExporter

PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """Owns its provider (not the global one), so two gateways in a process do not mix."""

    def __init__(self, settings: ServerSettings) -> None:
        self.enabled = settings.tracing is not TracingExporter.OFF
        self.provider: TracerProvider | None = None
        if not self.enabled:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvgate"}))
        if settings.tracing is TracingExporter.CONSOLE:
            self.provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:  # an optional extra
                raise RuntimeError(
                    "server.tracing = 'otlp' needs: pip install 'kvgate[otel]'"
                ) from exc
            exporter = (
                OTLPSpanExporter(endpoint=settings.otlp_endpoint)
                if (settings.otlp_endpoint)
                else OTLPSpanExporter()
            )
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvgate")

    def inject(self, headers: dict[str, str]) -> None:
        """Add traceparent/tracestate of the current span to outgoing engine headers."""
        if self.enabled:
            PROPAGATOR.inject(headers)

    def extract(self, headers: dict[str, str]):  # -> Context
        return PROPAGATOR.extract(headers) if self.enabled else None

    def headers_for(self, span: trace.Span) -> dict[str, str]:
        """traceparent/tracestate naming ``span`` as the parent (a request the endpoint picker
        routes: Envoy sets them on the request to the engine)."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
