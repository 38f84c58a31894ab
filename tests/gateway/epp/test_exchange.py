"""The ext_proc message handling, with Envoy's real protobuf types and no Envoy: what the
picker answers to each message, in both body modes, and that the books close every time."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from config.settings import (
    AdmissionMode,
)
from gateway.epp import protocol as pr
from gateway.epp.envoy import endpoint_of
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from tests.gateway.epp.messages import (
    URLS,
    body_msg,
    colocated_gateway,
    headers_msg,
    request_headers_msg,
    set_headers_of,
)


def _run(coro):
    return asyncio.run(coro)


def test_duplex_request_is_held_then_picked_and_streamed_back() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=2))
        body = json.dumps({"prompt": "word " * 30_000, "max_tokens": 4}).encode()
        assert await ex.handle(request_headers_msg()) == []  # held until the body ended
        half = len(body) // 2
        assert await ex.handle(body_msg(body[:half], False)) == []
        out = await ex.handle(body_msg(body[half:], True))
        return gw, ex, body, out

    gw, ex, body, out = _run(run())
    head, chunks = out[0], out[1:]
    assert head.WhichOneof("response") == "request_headers"
    common = head.request_headers.response
    assert common.clear_route_cache
    dest = set_headers_of(common.header_mutation)[pr.DESTINATION_HEADER]
    md = head.dynamic_metadata.fields[pr.LB_NAMESPACE].struct_value.fields
    assert md[pr.DESTINATION_HEADER].string_value == dest  # header and metadata agree
    primary, *fallbacks = dest.split(",")
    rid = ex.flight.request_id
    assert rid == "rid-1"
    assert primary == endpoint_of(URLS[gw.conductor.requests[rid].decision.prefill])
    assert len(fallbacks) == 2 and primary not in fallbacks
    # The body comes back whole, in pieces Envoy accepts, the last one marked.
    pieces = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(p.body for p in pieces) == body
    assert all(len(p.body) <= pr.MAX_CHUNK for p in pieces)
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert gw.drain.active == 1


def test_response_is_observed_and_the_books_close() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=0))
        body = json.dumps({"prompt": "hello " * 40, "max_tokens": 3, "stream": True}).encode()
        await ex.handle(request_headers_msg())
        await ex.handle(body_msg(body, True))
        rid = ex.flight.request_id
        assert rid in gw.conductor.requests
        reply = await ex.handle(
            ext.ProcessingRequest(response_headers=headers_msg({":status": "200"}))
        )
        events = [
            b'data: {"choices":[{"text":"a"}]}\n\n',
            b'data: {"choices":[{"text":"b"}]}\n\ndata: {"choices":[{"text":"c"}]}\n\n',
            b'data: {"choices":[],"usage":{"prompt_tokens":60,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":16}}}\n\ndata: [DONE]\n\n',
        ]
        streamed = []
        for i, e in enumerate(events):
            streamed += await ex.handle(body_msg(e, i == len(events) - 1, response=True))
        return gw, ex, reply, streamed

    gw, ex, reply, streamed = _run(run())
    added = set_headers_of(reply[0].response_headers.response.header_mutation)
    assert added["x-kvgate-prefill"] == ex.flight.decision.prefill
    assert added["x-request-id"] == "rid-1"
    passed = [r.response_body.response.body_mutation.streamed_response for r in streamed]
    assert passed[-1].end_of_stream and b"[DONE]" in passed[-1].body
    f = ex.flight
    assert f.closed and f.record.outcome == "completed"
    assert f.tokens == 3 and f.record.observed_ttft_s is not None
    assert gw.conductor.requests == {} and gw.drain.active == 0
    assert all(not i.prefill_queue and not i.running for i in gw.conductor.instances.values())


def test_buffered_mode_answers_headers_at_once_and_picks_on_the_body() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=1))
        first = await ex.handle(request_headers_msg(duplex=False))
        body = json.dumps({"prompt": "x " * 10, "max_tokens": 2}).encode()
        second = await ex.handle(body_msg(body, True))
        ex.close()  # Envoy went away before any answer
        return gw, first, second

    gw, first, second = _run(run())
    assert first[0].WhichOneof("response") == "request_headers"
    assert not first[0].request_headers.HasField("response")  # a plain continue
    common = second[0].request_body.response
    dest = set_headers_of(common.header_mutation)[pr.DESTINATION_HEADER]
    md = second[0].dynamic_metadata.fields[pr.LB_NAMESPACE].struct_value.fields
    assert len(dest.split(",")) == 2 and md[pr.DESTINATION_HEADER].string_value == dest
    assert gw.conductor.requests == {} and gw.drain.active == 0  # the broken stream closed them


def test_rejection_is_an_immediate_429_with_the_serve_body() -> None:
    async def run():
        gw = colocated_gateway(AdmissionMode.EARLY)
        ex = Exchange(Picker(gw))
        await ex.handle(request_headers_msg({"x-slo-ttft-ms": "50"}))
        body = json.dumps({"prompt": "word " * 4000, "max_tokens": 2}).encode()
        return gw, await ex.handle(body_msg(body, True))

    gw, out = _run(run())
    imm = out[0].immediate_response
    assert imm.status.code == 429
    headers = set_headers_of(imm.headers)
    assert int(headers["retry-after"]) >= 1
    assert headers["x-kvgate-reject-reason"] == "ttft_slo"
    assert headers["content-type"] == "application/json"
    err = json.loads(imm.body)["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "ttft_slo"
    assert gw.conductor.requests == {} and gw.drain.active == 0


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [(b"{not json", 400, None), (b'{"prompt": "x", "stream": "yes"}', 400, "stream")],
)
def test_bad_request_is_an_immediate_4xx_openai_error(raw: bytes, status: int, param) -> None:
    async def run():
        ex = Exchange(Picker(colocated_gateway()))
        await ex.handle(request_headers_msg())
        return await ex.handle(body_msg(raw, True))

    imm = _run(run())[0].immediate_response
    assert imm.status.code == status
    err = json.loads(imm.body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param


def test_upstream_error_status_closes_the_books_as_failed() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=0))
        await ex.handle(request_headers_msg())
        await ex.handle(body_msg(json.dumps({"prompt": "y", "max_tokens": 2}).encode(), True))
        await ex.handle(ext.ProcessingRequest(response_headers=headers_msg({":status": "503"})))
        await ex.handle(body_msg(b"upstream connect error", True, response=True))
        return gw, ex

    gw, ex = _run(run())
    assert ex.flight.record.outcome == "failed"
    assert gw.conductor.requests == {} and gw.drain.active == 0


def test_bodyless_request_to_another_path_goes_to_an_engine_without_books() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw))
        h = ext.ProcessingRequest(
            request_headers=headers_msg({":method": "GET", ":path": "/v1/models"}, end=True)
        )
        return gw, await ex.handle(h)

    gw, out = _run(run())
    dest = set_headers_of(out[0].request_headers.response.header_mutation)[pr.DESTINATION_HEADER]
    assert dest in {endpoint_of(u) for u in URLS.values()}
    assert gw.conductor.requests == {}


def test_body_past_the_limit_is_a_413_at_once() -> None:
    async def run():
        gw = colocated_gateway()
        gw.settings = replace(gw.settings, server=replace(gw.settings.server, max_body_bytes=1000))
        ex = Exchange(Picker(gw))
        await ex.handle(request_headers_msg())
        first = await ex.handle(body_msg(b"x" * 600, False))
        second = await ex.handle(body_msg(b"x" * 600, False))  # not the end yet: answered now
        return gw, ex, first, second

    gw, ex, first, second = _run(run())
    assert first == []
    assert second[0].immediate_response.status.code == 413
    assert (
        "larger than 1000 bytes"
        in json.loads(second[0].immediate_response.body)["error"]["message"]
    )
    assert ex.body == [] and gw.conductor.requests == {}


def test_trailers_end_a_duplex_request_and_pick_it() -> None:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=0))
        await ex.handle(request_headers_msg())
        body = json.dumps({"prompt": "t " * 20, "max_tokens": 2}).encode()
        assert await ex.handle(body_msg(body, False)) == []
        out = await ex.handle(ext.ProcessingRequest(request_trailers=ext.HttpTrailers()))
        ex.close()
        return gw, body, out

    gw, body, out = _run(run())
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    piece = out[1].request_body.response.body_mutation.streamed_response
    assert piece.body == body and not piece.end_of_stream  # the trailers end the request
    assert gw.conductor.requests == {} and gw.drain.active == 0


def test_a_failure_after_the_decision_still_closes_the_books() -> None:
    async def run():
        gw = colocated_gateway()
        picker = Picker(gw)

        def unresolvable(instance_id: str) -> str:
            raise OSError(f"cannot resolve {instance_id}")

        picker.addresses.of = unresolvable  # type: ignore[method-assign]
        ex = Exchange(picker)
        await ex.handle(request_headers_msg())
        with pytest.raises(OSError):
            await ex.handle(body_msg(json.dumps({"prompt": "z", "max_tokens": 2}).encode(), True))
        return gw

    gw = _run(run())
    assert gw.conductor.requests == {} and gw.drain.active == 0
