"""A completion with a list of prompts: one request per prompt through the proxy path, one
answer in the engine's batch shape (gateway/batched_prompts.py), on emulated engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from gateway.batched_prompts import batch_of_prompts
from gateway.openai import BadRequest
from gateway.stack import LiveStack, StackSpec
from tests.gateway.live import with_stack

LONG_A = "alpha beta gamma delta " * 60
LONG_B = "one two three four five six " * 60


def test_a_list_of_two_or_more_prompts_is_a_batch() -> None:
    assert batch_of_prompts({"prompt": "hello"}, 8) is None
    assert batch_of_prompts({"prompt": [1, 2, 3]}, 8) is None  # one prompt of token ids
    assert batch_of_prompts({"prompt": ["hello"]}, 8) is None  # a batch of one: as it is
    assert batch_of_prompts({"prompt": [[1, 2]]}, 8) is None
    assert batch_of_prompts({"prompt": ["a", "b"]}, 8) == ["a", "b"]
    assert batch_of_prompts({"prompt": [[1], [2, 3]]}, 8) == [[1], [2, 3]]
    with pytest.raises(BadRequest, match=r"prompt\[1\]: a batch is an array of strings or"):
        batch_of_prompts({"prompt": ["a", [1, 2]]}, 8)
    with pytest.raises(BadRequest, match=r"prompt\[1\]: 'prompt' must not be empty"):
        batch_of_prompts({"prompt": ["a", ""]}, 8)
    with pytest.raises(BadRequest, match=r"prompt\[0\]: a batch is an array of strings or"):
        batch_of_prompts({"prompt": [{"x": 1}, "b"]}, 8)
    with pytest.raises(BadRequest, match=r"prompt\[1\]: a batch is an array of strings or"):
        batch_of_prompts({"prompt": [[1], ["x"]]}, 8)
    with pytest.raises(BadRequest, match=r"prompt\[1\]: 'prompt' must be a string or an array"):
        batch_of_prompts({"prompt": [[1], []]}, 8)
    with pytest.raises(BadRequest, match=r"prompt\[1\]: token ids must be in"):
        batch_of_prompts({"prompt": [[1], [-1]]}, 8)
    with pytest.raises(BadRequest, match="at most 2 per request"):
        batch_of_prompts({"prompt": ["a", "b", "c"]}, 2)


async def _with_stack(
    check: Callable[[LiveStack, aiohttp.ClientSession], Awaitable[Any]], time_scale: float = 0.02
) -> Any:
    return await with_stack(StackSpec(colocated=2, time_scale=time_scale), check)


def _books(stack: LiveStack) -> tuple[int, int]:
    c = stack.gateway.conductor
    return len(c.requests), sum(i.batch + len(i.incoming) for i in c.instances.values())


def test_a_batch_is_answered_in_the_engines_shape_and_counted_per_prompt() -> None:
    prompts: list[Any] = ["hello there", "five six seven eight", "general kenobi"]

    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        singles = []
        for p in prompts:
            body = {"prompt": p, "max_tokens": 3}
            async with s.post(stack.url + "/v1/completions", json=body) as r:
                singles.append((await r.json())["usage"])
        body = {"prompt": prompts, "max_tokens": 3}  # n > 1: tests/real (the emulator: n=1)
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            answer = (r.status, r.headers.copy(), await r.json())
        metrics = stack.gateway.metrics.render().decode()
        return singles, answer, metrics, _books(stack)

    singles, (status, headers, body), metrics, books = asyncio.run(_with_stack(check))
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["id"] == f"cmpl-{headers['x-request-id']}"
    assert body["usage"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in singles)
    assert body["usage"]["completion_tokens"] == 3 * 3
    assert len(headers["x-kvgate-prefill"].split(",")) == 3
    assert 'kvgate_requests_total{outcome="completed"} 6.0' in metrics  # 3 singles + 3 prompts
    assert books == (0, 0)


def test_a_streamed_batch_has_one_usage_chunk_and_one_done_at_its_end() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        body = {
            "prompt": ["hello there", "general kenobi"],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            return r.status, r.headers["content-type"], (await r.read()).decode()

    status, content_type, text = asyncio.run(_with_stack(check))
    assert status == 200 and content_type.startswith("text/event-stream")
    events = [e[len("data: ") :] for e in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = [c for c in chunks if c.get("usage") is not None and not c["choices"]]
    assert len(usage) == 1 and usage[0] is chunks[-1]
    assert usage[0]["usage"]["completion_tokens"] == 8
    tokens = {0: 0, 1: 0}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            tokens[choice["index"]] += 1
    assert tokens == {0: 4, 1: 4}


def test_each_prompt_of_a_batch_goes_where_its_prefix_is_cached() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        where = {}
        for name, prefix in (("a", LONG_A), ("b", LONG_B)):
            for _ in range(2):  # the first places it, the second confirms where it is cached
                body = {"prompt": prefix + name, "max_tokens": 2}
                async with s.post(stack.url + "/v1/completions", json=body) as r:
                    where[name] = r.headers["x-kvgate-prefill"]
        body = {"prompt": [LONG_B + " tail", LONG_A + " tail"], "max_tokens": 2}
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            return where, r.status, r.headers["x-kvgate-prefill"]

    where, status, placed = asyncio.run(_with_stack(check))
    assert status == 200
    if where["a"] == where["b"]:
        pytest.skip(f"both prefixes were placed on {where['a']}: nothing to tell apart")
    assert placed.split(",") == [where["b"], where["a"]]


def test_a_bad_prompt_in_a_batch_is_refused_before_any_reaches_an_engine() -> None:
    async def check_books(stack: LiveStack, s: aiohttp.ClientSession):
        body = {"prompt": ["fine", "also fine", ""], "max_tokens": 2}
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            answer = r.status, await r.json()
        return answer, len(stack.gateway.learner.decisions)

    (status, body), decisions = asyncio.run(_with_stack(check_books))
    assert status == 400
    assert body["error"]["message"] == "prompt[2]: 'prompt' must not be empty"
    assert body["error"]["param"] == "prompt"
    assert decisions == 0  # no prompt was placed


def test_a_prompt_refused_by_admission_refuses_the_batch_and_aborts_the_others() -> None:
    """One prompt of the batch asks for a TTFT nothing meets (its own SLO header is per
    request, so here: a prompt far too long for the engine's context) ..."""

    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        body = {"prompt": ["short one", "word " * 400_000], "max_tokens": 2000}
        async with s.post(stack.url + "/v1/completions", json=body) as r:
            answer = r.status, await r.json()
        for _ in range(100):
            if _books(stack) == (0, 0):
                break
            await asyncio.sleep(0.05)
        return answer, _books(stack)

    (status, body), books = asyncio.run(_with_stack(check))
    assert status >= 400 and "error" in body, body
    assert books == (0, 0)


def test_a_client_leaving_a_streamed_batch_aborts_every_prompt() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        body = {"prompt": [[7, 8, 9, 10], [4, 5], [1, 2, 3]], "max_tokens": 2000}
        resp = await s.post(stack.url + "/v1/completions", json={**body, "stream": True})
        await resp.content.readany()  # every prompt's answer has started
        resp.close()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if _books(stack) == (0, 0):
                break
        metrics = stack.gateway.metrics.render().decode()
        return _books(stack), metrics

    books, metrics = asyncio.run(_with_stack(check, time_scale=1.0))
    assert books == (0, 0)
    assert 'kvgate_requests_total{outcome="client_disconnected"} 3.0' in metrics


def test_a_client_leaving_a_whole_batch_aborts_every_prompt() -> None:
    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        body = {"prompt": ["hello there", "general kenobi"], "max_tokens": 2000}
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(s.post(stack.url + "/v1/completions", json=body), 0.5)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if _books(stack) == (0, 0):
                break
        return _books(stack), stack.gateway.metrics.render().decode()

    books, metrics = asyncio.run(_with_stack(check, time_scale=1.0))
    assert books == (0, 0)
    assert 'kvgate_requests_total{outcome="client_disconnected"} 2.0' in metrics


def test_a_batch_whose_body_holds_an_integer_beyond_64_bits_is_answered() -> None:
    """Found by the schemathesis fuzz: each prompt's body is encoded again, and orjson refuses
    integers beyond 64 bits (the body was parsed with them); the batch waited forever."""

    async def check(stack: LiveStack, s: aiohttp.ClientSession):
        raw = b'{"prompt": ["a", "b"], "max_tokens": 2, "x": 71524912693046438392758272}'
        headers = {"content-type": "application/json"}
        post = s.post(stack.url + "/v1/completions", data=raw, headers=headers)
        async with await asyncio.wait_for(post, 10) as r:
            return r.status, await r.json()

    status, body = asyncio.run(_with_stack(check))
    assert status == 200 and len(body["choices"]) == 2
