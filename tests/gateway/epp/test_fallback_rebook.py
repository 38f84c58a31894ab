"""Envoy served a request from a fallback endpoint (the pick was unreachable): the picker
moves the books to the engine that served (its queue, its cache view, the decision record),
and learns nothing from that answer (its TTFT includes the failed try at the pick). Envoy's
real protobuf types, no Envoy; the real-Envoy path is tests/gateway/epp/test_envoy.py."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from gateway.epp import protocol as pr
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from tests.gateway.epp.messages import (
    URLS,
    body_msg,
    colocated_gateway,
    headers_msg,
    request_headers_msg,
)


def _answers(hist: object) -> float:
    """How many observations a prometheus histogram holds."""
    return sum(
        s.value
        for m in hist.collect()  # type: ignore[attr-defined]
        for s in m.samples
        if s.name.endswith("_count")
    )


def _serve(served_by_fallback: bool) -> tuple[object, object, str, str, tuple[int, ...]]:
    async def run():
        gw = colocated_gateway()
        ex = Exchange(Picker(gw, fallbacks=1))
        prompt = "a prompt whose prefix the pick was credited with " * 20
        body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
        await ex.handle(request_headers_msg())
        await ex.handle(body_msg(body, True))
        f = ex.flight
        pick = f.decision.prefill
        blocks = gw.conductor.requests[f.request_id].request.block_hashes
        assert gw.conductor.index.is_predicted(pick, blocks[-1])
        served = f.endpoints[1] if served_by_fallback else f.endpoints[0]
        await ex.handle(
            ext.ProcessingRequest(
                response_headers=headers_msg({":status": "200", pr.SERVED_HEADER: served})
            )
        )
        moved = f.decision.prefill
        if served_by_fallback:  # the books moved before the answer's body came
            queue = gw.conductor.instances[moved].prefill_queue
            assert f.request_id in queue
            assert f.request_id not in gw.conductor.instances[pick].prefill_queue
            assert not gw.conductor.index.is_predicted(pick, blocks[-1])
            assert gw.conductor.index.is_predicted(moved, blocks[-1])
        answer = b'{"choices":[{"text":"ok"}],"usage":{"prompt_tokens":200,"completion_tokens":2}}'
        await ex.handle(body_msg(answer, True, response=True))
        return gw, f, pick, moved, blocks

    return asyncio.run(run())


def test_a_fallback_that_served_takes_the_books_with_it() -> None:
    gw, f, pick, moved, _ = _serve(served_by_fallback=True)
    assert moved != pick and URLS[moved]  # one of the engines, not the pick
    assert f.rebooked and f.record.prefill == moved and f.record.reason == "fallback"
    assert f.record.outcome == "completed" and f.closed
    assert gw.conductor.requests == {} and gw.drain.active == 0
    assert all(not i.prefill_queue and not i.running for i in gw.conductor.instances.values())
    assert gw.metrics.retries._value.get() == 1
    assert _answers(gw.metrics.ttft_error) == 0  # the failed try is in its TTFT: not learnt


def test_the_pick_that_served_keeps_its_books_and_teaches() -> None:
    gw, f, pick, moved, _ = _serve(served_by_fallback=False)
    assert moved == pick and not f.rebooked and f.record.reason != "fallback"
    assert gw.metrics.retries._value.get() == 0
    assert _answers(gw.metrics.ttft_error) == 1
