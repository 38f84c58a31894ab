"""Late decode binding through the live gateway: vLLM P/D emulators, one prefill and two decode
instances. The rebind target is forced (which instance the books would pick is tested in
tests/routing/test_decode_rebind.py); what is tested here is the wiring: the decode leg goes to
the new instance, the answer says so, and the books follow and return to zero."""

from __future__ import annotations

import pytest
from openai import OpenAI

import routing.request_progress as progress
from config.settings import PDProtocol
from gateway.stack import StackSpec
from routing.instance_books import InstanceState
from tests.gateway.live import live_stack


@pytest.fixture(scope="module")
def stack():
    with live_stack(
        StackSpec(prefill=1, decode=2, protocol=PDProtocol.VLLM, time_scale=0.02, model="m")
    ) as s:
        yield s


def _other(planned: InstanceState, pool: list[InstanceState], *_: object) -> InstanceState:
    return next(x for x in pool if x is not planned)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_leg_goes_where_the_books_moved_it(stack, monkeypatch, stream) -> None:
    gw = stack.gateway
    before = gw.conductor.stats.rebinds
    planned: list[str] = []
    real = gw.conductor.rebind_decode

    def watch(rid: str, now: float) -> str | None:
        planned.append(gw.conductor.requests[rid].decision.decode)
        return real(rid, now)

    monkeypatch.setattr(progress, "rebind_target", _other)
    monkeypatch.setattr(gw.conductor, "rebind_decode", watch)
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    raw = client.completions.with_raw_response.create(
        model="m", prompt="late binding " * 30, max_tokens=4, stream=stream
    )
    if stream:
        texts = [c.choices[0].text for c in raw.parse() if c.choices]
        assert len(texts) == 4
    else:
        assert raw.parse().usage.completion_tokens == 4
    (first,) = planned
    moved = raw.headers["x-kvgate-decode"]
    assert moved in ("d0", "d1") and moved != first
    assert stack.call(lambda: gw.conductor.stats.rebinds) == before + 1

    def books():
        return sum(
            i.batch + len(i.incoming) + len(i.prefill_queue)
            for i in gw.conductor.instances.values()
        ), len(gw.conductor.requests)

    assert stack.call(books) == (0, 0)


def test_no_rebind_when_switched_off(stack, monkeypatch) -> None:
    """``routing.decode_rebind = false``: the driver is never asked."""
    from dataclasses import replace

    gw = stack.gateway
    asked: list[str] = []
    monkeypatch.setattr(gw.conductor, "rebind_decode", lambda rid, now: asked.append(rid))
    off = replace(gw.settings, routing=replace(gw.settings.routing, decode_rebind=False))
    monkeypatch.setattr(gw, "settings", off)
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = client.completions.create(model="m", prompt="stay " * 30, max_tokens=2)
    assert r.usage.completion_tokens == 2 and asked == []
