"""``/v1/responses`` behind Envoy: the picker places it by the chat prompt its engine renders,
keeps its stream in the books by its delta events, learns which instance made each response
and sends a follow-up there (gateway/responses_api.py, as `kvgate serve` does)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from config.settings import AdmissionMode
from gateway.epp.picker import Flight, Picker, Waiting
from tests.gateway.epp.messages import colocated_gateway

DATA = Path(__file__).parents[2] / "backends" / "data"
URLS = {"a": "http://127.0.0.1:41601", "b": "http://127.0.0.1:41602"}


def _pick(picker: Picker, body: dict) -> Flight:
    out = asyncio.run(picker.pick("/v1/responses", {}, json.dumps(body).encode()))
    assert isinstance(out, Flight) and not isinstance(out, Waiting), out
    return out


def test_a_follow_up_is_placed_on_the_instance_that_made_its_response() -> None:
    gw = colocated_gateway(AdmissionMode.NONE, URLS)
    picker = Picker(gw, fallbacks=0)
    first = _pick(picker, {"model": "m", "input": "hello " * 50, "max_output_tokens": 4})
    owner = first.decision.decode
    picker.response_started(first, 200)
    whole = (DATA / "vllm_0_32_responses.json").read_bytes()
    picker.chunk(first, whole)
    picker.finished(first)
    made = json.loads(whole)["id"]
    assert picker.responses.owners.owner(made) == owner
    # Open answers on the owner make it the busier one: new requests go to the other...
    held = [_pick(picker, {"model": "m", "input": f"load {i} " * 50}) for i in range(4)]
    control = _pick(picker, {"model": "m", "input": "unrelated " * 50})
    # ...and a follow-up still goes to the owner, the only engine that stored the response.
    follow = _pick(picker, {"model": "m", "input": "more", "previous_response_id": made})
    assert control.decision.decode != owner, [h.decision.decode for h in held]
    assert follow.decision.decode == owner and follow.endpoints[0].endswith(URLS[owner][-5:])
    assert follow.parsed.body["previous_response_id"] == made  # the client's body goes on
    assert "messages" not in follow.parsed.body


def test_a_responses_stream_counts_its_tokens_from_its_usage_and_first_delta() -> None:
    gw = colocated_gateway(AdmissionMode.NONE, URLS)
    picker = Picker(gw, fallbacks=0)
    clock = [100.0]
    gw.clock = lambda: clock[0]  # type: ignore[method-assign]
    f = _pick(picker, {"model": "m", "input": "count", "max_output_tokens": 5, "stream": True})
    rid = f.request_id
    picker.response_started(f, 200)
    events = [
        e + b"\n\n"
        for e in (DATA / "vllm_0_32_responses_stream.txt").read_bytes().split(b"\n\n")
        if e
    ]
    clock[0] = 101.0
    picker.chunk(f, b"".join(events[:2]))  # response.created, response.in_progress
    assert f.record.observed_ttft_s is None  # no token yet
    for i, event in enumerate(events[2:]):
        clock[0] = 102.0 + i
        picker.chunk(f, event)
    usage = json.loads(events[-1].split(b"data: ", 1)[1])["response"]["usage"]
    picker.finished(f)
    assert f.record.observed_ttft_s == 4.0  # the first delta's (104), not the opening's (101)
    # from the first token, over the engine's 5 tokens (4 delta events): not from the opening
    assert f.record.observed_tbt_s == (clock[0] - 104.0) / (5 - 1)
    assert rid not in gw.conductor.requests and usage["output_tokens"] == 5
    made = json.loads(events[0].split(b"data: ", 1)[1])["response"]["id"]
    assert picker.responses.owners.owner(made) == f.decision.decode
