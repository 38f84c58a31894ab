"""The emulator's batched completion prompts, as vLLM serves them: one engine request per
prompt, one answer (choices by prompt, summed usage; streamed: each chunk names its prompt,
one usage chunk, one [DONE])."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from replay.emulator import RunningEmulator
from replay.emulator.batch_serving import batch_of_prompts
from replay.emulator.openai_api import RequestError
from tests.replay.emulator.test_server import run

A, B, C = "alpha beta " * 40, "one two three " * 40, "x y z " * 40


def test_what_is_a_batch() -> None:
    assert batch_of_prompts({"prompt": "one"}) is None
    assert batch_of_prompts({"prompt": [1, 2, 3]}) is None  # token ids: one prompt
    assert batch_of_prompts({"prompt": ["one"]}) is None  # a batch of one: as it is
    assert batch_of_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert batch_of_prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]
    with pytest.raises(RequestError, match="a batch is a list of strings or"):
        batch_of_prompts({"prompt": ["a", [1, 2]]})


def test_a_batch_is_one_request_per_prompt_and_one_answer() -> None:
    got: dict[str, Any] = {}

    async def body(emu: RunningEmulator, s: aiohttp.ClientSession) -> None:
        singles = []
        for p in (A, B):  # cached now: the batch below finds them
            async with s.post(
                emu.url + "/v1/completions", json={"prompt": p, "max_tokens": 2}
            ) as r:
                singles.append((await r.json())["usage"])
        async with s.post(
            emu.url + "/v1/completions", json={"prompt": [A, B, C], "max_tokens": 3}
        ) as r:
            got["whole"] = (r.status, await r.json())
        stream = {"prompt": [C, A], "max_tokens": 4, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
        async with s.post(emu.url + "/v1/completions", json=stream) as r:
            got["stream"] = (r.status, (await r.read()).decode())
        async with s.post(emu.url + "/v1/completions", json={"prompt": ["a", [1]]}) as r:
            got["mixed"] = (r.status, await r.json())
        async with s.get(emu.url + "/metrics") as r:
            got["metrics"] = await r.text()
        got["singles"] = singles

    run(body)
    status, whole = got["whole"]
    assert status == 200 and [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 9
    singles = got["singles"]
    assert whole["usage"]["prompt_tokens"] > sum(u["prompt_tokens"] for u in singles)
    # A and B were cached by the singles: each prompt found its own prefix
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, text = got["stream"]
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert sorted(tokens) == [0] * 4 + [1] * 4
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 8
    assert got["mixed"][0] == 400 and got["mixed"][1]["error"]["param"] == "prompt"
    assert "vllm:num_requests_running" in got["metrics"]
