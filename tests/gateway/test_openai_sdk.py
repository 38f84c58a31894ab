"""The real openai SDK against the gateway in front of emulators, vLLM and SGLang P/D."""

from __future__ import annotations

import pytest
from openai import OpenAI

from config.settings import PDProtocol
from gateway.stack import StackSpec
from tests.gateway.live import live_stack


@pytest.fixture(scope="module", params=[PDProtocol.VLLM, PDProtocol.SGLANG], ids=["vllm", "sglang"])
def stack(request):
    with live_stack(
        StackSpec(prefill=1, decode=1, protocol=request.param, time_scale=0.02, model="m")
    ) as s:
        yield s


def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_completion_non_streaming(stack) -> None:
    r = client(stack).completions.create(model="m", prompt="The capital of France is", max_tokens=5)
    assert r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 5


def test_completion_streaming(stack) -> None:
    chunks = list(
        client(stack).completions.create(
            model="m", prompt="Once upon a time", max_tokens=6, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6


def test_chat_non_streaming_and_streaming(stack) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
    r = client(stack).chat.completions.create(model="m", messages=msgs, max_tokens=4)
    assert r.choices[0].message.content
    stream = client(stack).chat.completions.create(
        model="m", messages=msgs, max_tokens=4, stream=True
    )
    deltas = [c.choices[0].delta.content for c in stream if c.choices]
    assert len([d for d in deltas if d]) == 4


def test_token_id_prompt_and_request_id_kept(stack) -> None:
    raw = client(stack).completions.with_raw_response.create(
        model="m",
        prompt=list(range(100, 164)),
        max_tokens=2,
        extra_headers={"X-Request-Id": "my-id-1"},
    )
    assert raw.headers["x-request-id"] == "my-id-1"
    assert raw.headers["x-kvgate-prefill"] in ("p0",)
    assert raw.headers["x-kvgate-decode"] in ("d0",)
    assert raw.parse().usage.completion_tokens == 2


def test_books_return_to_zero(stack) -> None:
    c = client(stack)
    for i in range(3):
        c.completions.create(model="m", prompt=f"request {i} " * 20, max_tokens=3)
    gw = stack.gateway

    def books():
        return (
            len(gw.conductor.requests),
            sum(
                i.batch + len(i.incoming) + len(i.prefill_queue)
                for i in gw.conductor.instances.values()
            ),
        )

    assert stack.call(books) == (0, 0)


@pytest.fixture(scope="module")
def colocated():
    with live_stack(StackSpec(colocated=2, time_scale=0.02, model="m")) as s:
        yield s


def test_responses_whole_streamed_and_continued(colocated) -> None:
    c = client(colocated)
    first = c.responses.create(model="m", instructions="Be terse.", input="Hi", max_output_tokens=4)
    assert first.output_text and first.usage is not None and first.usage.output_tokens == 4
    events = list(c.responses.create(model="m", input="Count", max_output_tokens=5, stream=True))
    assert [e.type for e in events].count("response.output_text.delta") == 5
    assert events[-1].type == "response.completed"
    follow = c.responses.create(
        model="m", input="More", max_output_tokens=2, previous_response_id=first.id
    )
    assert follow.previous_response_id == first.id
