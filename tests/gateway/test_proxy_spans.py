"""Tracing in the proxy (``server.tracing``, gateway/proxy.py + gateway/tracing.py): one trace
from the client's ``traceparent`` through kvgate's spans (the request, its decision) to the
engine, which gets the trace context on its request. Real Gateway and handler, a fake engine
answer (bench/hot_path_cost.py's), the OpenTelemetry SDK with an in-memory exporter."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.hot_path_cost import FakeEngineAnswer, body_receiver
from config.loader import settings_from_dict
from config.settings import TracingExporter
from gateway.app import build_app
from gateway.proxy import CompletionHandler

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


class RecordingDriver:
    """Answers at once and keeps each plan (the headers kvgate sends the engine)."""

    def __init__(self) -> None:
        self.plans: list[Any] = []

    async def open(self, session: Any, plan: Any) -> FakeEngineAnswer:
        self.plans.append(plan)
        return FakeEngineAnswer()


def test_one_trace_from_the_client_through_the_decision_to_the_engine(capsys) -> None:
    raw = {
        "server": {"tracing": "console", "health_interval_s": 3600.0, "refit_interval_s": 0},
        "pools": [
            {"name": "w", "role": "both", "instances": [{"id": "w0", "url": "http://127.0.0.1:9"}]}
        ],
    }
    settings = settings_from_dict(raw, "traced.toml")
    assert settings.server.tracing is TracingExporter.CONSOLE
    gw = build_app(replace(settings)).gateway
    driver = RecordingDriver()
    gw.driver = driver  # type: ignore[assignment]
    exporter = InMemorySpanExporter()
    assert gw.tracing.provider is not None
    gw.tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi " * 20}], "stream": True}
    ).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json"), (b"traceparent", TRACEPARENT.encode())],
    }
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await CompletionHandler(gw)(scope, body_receiver(body, never), send)

    asyncio.run(run())
    assert sent[0]["status"] == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request, decision = spans["kvgate.request"], spans["kvgate.decision"]
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    assert decision.parent is not None and decision.parent.span_id == request.context.span_id
    (plan,) = driver.plans
    engine_trace = plan.headers["traceparent"].split("-")[1]
    assert engine_trace == CLIENT_TRACE  # the engine's spans join the same trace
    capsys.readouterr()  # the console exporter's print-out
