"""Tracing behind Envoy (``server.tracing``): a ``kvgate.request`` span from the pick to the end
of the answer, a child of the client's W3C trace context, with a ``kvgate.decision`` child; the
engine gets the request's traceparent through Envoy; a rejection ends its span at once. Real
Gateway and OpenTelemetry SDK (an in-memory exporter), Envoy's real protobuf types, no Envoy."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from config.settings import Settings, TracingExporter
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from gateway.runtime import Gateway
from tests.gateway.epp.messages import (
    body_msg,
    colocated_gateway,
    request_headers_msg,
    set_headers_of,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def _traced() -> tuple[Gateway, InMemorySpanExporter]:
    server = replace(Settings().server, tracing=TracingExporter.CONSOLE)
    traced = colocated_gateway(server=server)
    exporter = InMemorySpanExporter()
    assert traced.tracing.provider is not None
    traced.tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return traced, exporter


def test_a_placed_request_is_one_trace_from_the_client_to_the_engine(capsys) -> None:
    async def run():
        gw, exporter = _traced()
        ex = Exchange(Picker(gw))
        await ex.handle(request_headers_msg({"traceparent": TRACEPARENT}))
        body = json.dumps({"prompt": "hello " * 20, "max_tokens": 2}).encode()
        out = await ex.handle(body_msg(body, True))
        open_spans = [s.name for s in exporter.get_finished_spans()]
        ex.close()  # the stream ends: the request span ends with its outcome
        return out, open_spans, exporter.get_finished_spans()

    out, before_close, spans = asyncio.run(run())
    assert before_close == ["kvgate.decision"]  # the request's span lasts as long as its answer
    by_name = {s.name: s for s in spans}
    request, decision = by_name["kvgate.request"], by_name["kvgate.decision"]
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE  # the client's trace goes on
    assert decision.parent.span_id == request.context.span_id
    assert request.attributes["kvgate.request_id"] == "rid-1"
    assert request.attributes["kvgate.prefill"] in ("a", "b", "c")
    assert request.attributes["kvgate.outcome"] == "client_disconnected"
    sent = set_headers_of(out[0].request_headers.response.header_mutation)
    assert sent["traceparent"].split("-")[1:3] == [CLIENT_TRACE, f"{request.context.span_id:016x}"]
    capsys.readouterr()  # the console exporter's print-out


def test_a_rejection_ends_its_span_at_once(capsys) -> None:
    async def run():
        gw, exporter = _traced()
        ex = Exchange(Picker(gw))
        await ex.handle(request_headers_msg({"x-slo-ttft-ms": "50"}))
        body = json.dumps({"prompt": "word " * 4000, "max_tokens": 2}).encode()
        out = await ex.handle(body_msg(body, True))
        return out, exporter.get_finished_spans()

    out, spans = asyncio.run(run())
    assert out[0].immediate_response.status.code == 429
    (request,) = [s for s in spans if s.name == "kvgate.request"]
    assert request.attributes["kvgate.outcome"] == "rejected"
    capsys.readouterr()
