"""A pick turned away on its TBT check waits for decode room behind Envoy as under `kvgate
serve` (gateway/decode_waits.py): the exchange first asks Envoy to extend its message timer,
then answers once a finished decode admitted the request, or with its 429 when the wait ended.
Real Gateway and Conductor (one engine whose decode batch today fails the TBT SLO), Envoy's
real protobuf types, no Envoy (tests/gateway/epp/test_envoy.py runs one)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from config.settings import (
    SLOSettings,
)
from gateway.epp import protocol as pr
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from gateway.runtime import Gateway
from routing.instance_books import DecodeWork
from tests.gateway.epp.messages import (
    body_msg,
    colocated_gateway,
    request_headers_msg,
    set_headers_of,
)

BODY = json.dumps({"prompt": "hello " * 50, "max_tokens": 4}).encode()


def _full_gateway() -> Gateway:
    """One colocated engine whose batch today (100 sequences of 3,000 tokens) fails a 20 ms
    TBT SLO, while the request alone in a batch would pass it: it may wait."""
    gw = colocated_gateway(
        urls={"a": "http://127.0.0.1:41001"}, slo=SLOSettings(ttft_s=10.0, tbt_s=0.02)
    )
    a = gw.conductor.instances["a"]
    for i in range(100):
        a.add_incoming(DecodeWork(f"run{i}", 3000, 10, 0.0))
        a.start_decode(f"run{i}", 0.0)
    return gw


def _decodes_finish(gw: Gateway) -> None:
    now = gw.clock()
    for i in range(100):
        gw.conductor.instances["a"].remove_decode(f"run{i}", now)
    for hook in gw.conductor.after_finished:  # as Conductor.finished runs them
        hook(now)


async def _held(timeouts: pr.MessageTimeouts) -> tuple[Gateway, Exchange, list]:
    gw = _full_gateway()
    ex = Exchange(Picker(gw, timeouts=timeouts))
    assert await ex.handle(request_headers_msg()) == []
    return gw, ex, await ex.handle(body_msg(BODY, True))


def test_the_pick_waits_with_envoys_timer_extended_and_is_routed_when_a_decode_ends() -> None:
    async def run():
        gw, ex, first = await _held(pr.MessageTimeouts(message_s=2.0, max_message_s=60.0))
        assert ex.waiting and len(first) == 1
        (extend,) = first
        assert extend.HasField("override_message_timeout")
        asked = extend.override_message_timeout.ToTimedelta().total_seconds()
        assert "rid-1" in gw.conductor.decode_queue and "rid-1" not in gw.conductor.requests
        task = asyncio.create_task(ex.resume())
        await asyncio.sleep(0.01)
        assert not task.done()  # nothing finished yet
        _decodes_finish(gw)
        out = await asyncio.wait_for(task, 5)
        booked = "rid-1" in gw.conductor.requests
        ex.close()  # the stream ends without an answer: the books close
        return gw, ex, asked, out, booked

    gw, ex, asked, out, booked = asyncio.run(run())
    # its wait (90 % of the 10 s TTFT SLO), then the ordinary 2 s for the pick
    assert asked == pytest.approx(9.0 + 2.0, abs=0.05)
    headers = set_headers_of(out[0].request_headers.response.header_mutation)
    assert headers[pr.DESTINATION_HEADER] == "127.0.0.1:41001"
    assert out[-1].request_body.response.body_mutation.streamed_response.body == BODY
    assert booked and not ex.waiting
    assert gw.conductor.requests == {} and gw.drain.active == 0
    assert gw.conductor.decode_queue.admitted == 1


def test_a_wait_capped_by_envoys_max_message_timeout_ends_in_the_429() -> None:
    async def run():
        gw, ex, first = await _held(pr.MessageTimeouts(message_s=1.0, max_message_s=1.05))
        asked = first[0].override_message_timeout.ToTimedelta().total_seconds()
        return gw, asked, await asyncio.wait_for(ex.resume(), 5)

    gw, asked, out = asyncio.run(run())
    assert asked == pytest.approx(1.05, abs=0.01)  # 50 ms of waiting, then the pick's 1 s
    imm = out[0].immediate_response
    assert imm.status.code == 429
    assert set_headers_of(imm.headers)["x-kvgate-reject-reason"] == "tbt_slo"
    assert "rid-1" not in gw.conductor.decode_queue and gw.conductor.requests == {}


def test_no_waiting_when_envoy_cannot_extend_its_timer() -> None:
    async def run():
        return await _held(pr.MessageTimeouts(message_s=10.0, max_message_s=0.0))

    gw, ex, out = asyncio.run(run())
    assert not ex.waiting and out[0].immediate_response.status.code == 429
    assert len(gw.conductor.decode_queue) == 0


def test_a_stream_that_ends_while_waiting_leaves_nothing_behind() -> None:
    async def run():
        gw, ex, _ = await _held(pr.MessageTimeouts())
        task = asyncio.create_task(ex.resume())
        await asyncio.sleep(0.01)
        task.cancel()  # Envoy reset the stream (client gone)
        with pytest.raises(asyncio.CancelledError):
            await task
        ex.close()
        _decodes_finish(gw)  # a later release finds nobody waiting
        return gw

    gw = asyncio.run(run())
    assert len(gw.conductor.decode_queue) == 0 and gw.conductor.requests == {}
    assert gw.drain.active == 0
