"""``POST /v1/responses`` through the proxy path (gateway/responses_api.py) on emulated engines
that answer in vLLM's Responses shapes: placed by the chat prompt the engine renders, its stream
kept in the books by its delta events, a follow-up placed on the instance that made the
response it continues."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest

from config.settings import EngineKind, InstanceSettings, Role
from gateway.openai import BadRequest, RequestHead
from gateway.responses_api import ResponsesRoute, response_id
from gateway.stack import LiveStack, StackSpec
from tests.gateway.live import with_stack


def test_the_response_id_is_the_answers_first_id() -> None:
    whole = b'{"id": "resp_1", "output": [{"id": "msg_1"}]}'
    opening = b'event: response.created\ndata: {"response":{"id":"resp_2","output":[]}}\n\n'
    assert response_id(whole) == "resp_1" and response_id(opening) == "resp_2"
    assert response_id(b'{"error": {"message": "no"}}') is None


def _spec(iid: str, role: Role, engine: EngineKind = EngineKind.AUTO) -> InstanceSettings:
    return InstanceSettings(id=iid, url="http://127.0.0.1:1", role=role, engine=engine)


def test_a_follow_up_may_go_only_to_the_owner_and_pd_pools_refuse() -> None:
    specs = {s.id: s for s in (_spec("a", Role.BOTH), _spec("b", Role.BOTH))}
    route = ResponsesRoute(specs)
    route.answered("b", b'{"id":"resp_9","object":"response"}')
    head = RequestHead({"input": "hi", "previous_response_id": "resp_9"}, False, None, 10)
    chat, exclude = route.prompt(head)
    assert chat.body["messages"] == [{"role": "user", "content": "hi"}] and exclude == {"a"}
    assert chat.body["add_special_tokens"] is True  # vLLM's Responses tokenizing
    llama = ResponsesRoute({"l": _spec("l", Role.BOTH, EngineKind.LLAMACPP)})
    assert llama.prompt(head)[0].body["add_special_tokens"] is False  # llama.cpp's
    unknown = RequestHead({"input": "hi", "previous_response_id": "resp_x"}, False, None, 10)
    assert route.prompt(unknown)[1] == frozenset()  # not made here: the engines answer for it
    route.answered("gone", b'{"id":"resp_8"}')  # an instance since removed from the fleet
    gone = RequestHead({"input": "hi", "previous_response_id": "resp_8"}, False, None, 10)
    assert route.prompt(gone)[1] == frozenset()
    pd = ResponsesRoute({s.id: s for s in (_spec("p", Role.PREFILL), _spec("d", Role.DECODE))})
    with pytest.raises(BadRequest, match="colocated pools only"):
        pd.prompt(RequestHead({"input": "hi"}, False, None, 10))
    with pytest.raises(BadRequest, match="'input' is required"):
        route.prompt(RequestHead({"model": "m"}, False, None, 10))


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]):
    async with s.post(url + "/v1/responses", json=body) as r:
        raw = await r.read()
        return r.status, r.headers.get("x-kvgate-decode"), raw


def test_whole_and_streamed_answers_are_relayed_and_kept_in_the_books() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        body = {"model": "m", "instructions": "Be brief.", "input": "hello " * 40}
        whole = await _post(s, stack.url, {**body, "max_output_tokens": 4})
        streamed = await _post(s, stack.url, {**body, "max_output_tokens": 5, "stream": True})
        return whole, streamed, stack.gateway.metrics.render().decode(), stack.gateway

    whole, streamed, metrics, gw = asyncio.run(with_stack(StackSpec(colocated=2, model="m"), check))
    assert whole[0] == 200 and b'"output_tokens": 4' in whole[2]
    assert streamed[0] == 200 and streamed[2].count(b"event: response.output_text.delta") == 5
    assert streamed[2].rstrip().endswith(b'"type":"response.completed"}')
    assert 'kvgate_requests_total{outcome="completed"} 2.0' in metrics
    assert "kvgate_ttft_seconds_count 1.0" in metrics  # the stream's, at its first delta
    # the second found the first's prompt cached (same instructions and input)
    assert (
        gw.metrics.cache_feedback_count() if hasattr(gw.metrics, "cache_feedback_count") else True
    )
    assert len(gw.conductor.requests) == 0


def test_a_follow_up_goes_to_the_instance_that_made_its_response() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        status, owner, raw = await _post(s, stack.url, {"model": "m", "input": "first"})
        first = response_id(raw)
        # A long answer keeps the owner busy: a new request would go to the other instance.
        busy = asyncio.create_task(
            _post(
                s,
                stack.url,
                {"model": "m", "input": "go on", "max_output_tokens": 3000, "stream": True,
                 "previous_response_id": first},
            )
        )  # fmt: skip
        await asyncio.sleep(0.3)
        control = await _post(s, stack.url, {"model": "m", "input": "unrelated"})
        again = {"model": "m", "previous_response_id": first}
        follow = [await _post(s, stack.url, {**again, "input": f"and {i}?"}) for i in range(4)]
        unknown = await _post(
            s, stack.url, {"model": "m", "input": "x", "previous_response_id": "resp_nope"}
        )
        busy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await busy
        return status, owner, control, follow, unknown

    status, owner, control, follow, unknown = asyncio.run(
        with_stack(StackSpec(colocated=2, time_scale=0.05, model="m"), check)
    )
    assert status == 200 and owner is not None
    assert control[0] == 200 and control[1] != owner  # the follow-ups had somewhere else to go
    assert [(f[0], f[1]) for f in follow] == [(200, owner)] * 4
    assert unknown[0] == 404 and b"not found" in unknown[2]  # the engine's own answer


def test_prefill_decode_pools_refuse_it_with_a_clear_error() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        return await _post(s, stack.url, {"model": "m", "input": "hi"})

    status, _, raw = asyncio.run(with_stack(StackSpec(prefill=1, decode=1, model="m"), check))
    assert status == 400 and b"colocated pools only" in raw and b'"param": "model"' in raw
