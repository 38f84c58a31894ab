"""In front of a real vLLM, kvgate answers as the engine does and leaves it no orphan work:
a batch of prompts comes back in the engine's own batch shape, a Responses request is placed by
the very prompt the engine renders for it, a client that leaves before a whole answer has its
request aborted on the engine, and a burst of requests onto an idle engine runs there together
(default admission)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from config.loader import settings_from_dict
from gateway.app import build_app
from gateway.openai import CHAT
from gateway.responses_api import ResponsesRoute
from gateway.serve import start_server
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def vllm(vllm_install: EngineInstall) -> Iterator[EngineProcess]:
    (port,) = free_ports(1, 18200, 18260)
    # The Responses store on, as a user continuing responses runs it (previous_response_id).
    proc = start_vllm(port, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    yield proc
    stop_engine(proc)


def _gauge(url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples, over those whose labels hold ``labels`` if given."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for held, v in found if labels in held)


def _through_kvgate(
    engine: EngineProcess,
    check: Callable[[str, aiohttp.ClientSession, Any], Awaitable[Any]],
    admission: str = "none",
) -> Any:
    settings = settings_from_dict(
        {
            "server": {"health_interval_s": 10.0, "refit_interval_s": 0},
            "admission": {"mode": admission},
            "models": [{"name": "tiny", "pools": ["v"], "model_dir": str(engine.model_dir)}],
            "pools": [
                {"name": "v", "role": "both", "instances": [{"id": "v0", "url": engine.url}]}
            ],
        }
    )

    async def run() -> Any:
        app = build_app(settings)
        server = await start_server(app, "127.0.0.1", 0, lifespan="on")
        try:
            async with aiohttp.ClientSession() as s:
                return await check(server.url, s, app.gateway)
        finally:
            await server.stop()

    return asyncio.run(run())


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + "/v1/completions", json=body) as r:
        if body.get("stream"):
            return r.status, (await r.read()).decode()
        return r.status, await r.json()


def _events(text: str) -> list[Any]:
    out = []
    for event in text.strip().split("\n\n"):
        data = event.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_batch_of_prompts_comes_back_in_the_engines_batch_shape(vllm: EngineProcess) -> None:
    body = {
        "model": "tiny",
        "prompt": ["hello there", "five six seven eight", "general kenobi says hi"],
        "max_tokens": 3,
        "n": 2,
        "ignore_eos": True,
    }
    # Streamed: token-id prompts (a batch is all texts or all token-id arrays).
    stream = {
        **body,
        "prompt": [[5, 6, 7, 8], [9, 10, 11]],
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        return [await _post(s, base, b) for base in (vllm.url, url) for b in (body, stream)]

    (es, engine), (ess, engine_stream), (ks, kvgate), (kss, kvgate_stream) = _through_kvgate(
        vllm, check
    )
    assert es == ks == ess == kss == 200, (engine, kvgate)
    # Whole answers: the same choices, numbered prompt x n + choice, and the same usage.
    assert sorted(c["index"] for c in kvgate["choices"]) == list(range(6))
    assert sorted(c["index"] for c in engine["choices"]) == list(range(6))
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert kvgate["usage"][key] == engine["usage"][key], key
    # Streamed: every choice's tokens, one usage chunk with the engine's totals, one [DONE].
    for events in (_events(engine_stream), _events(kvgate_stream)):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    e_chunks, k_chunks = _events(engine_stream)[:-1], _events(kvgate_stream)[:-1]
    assert len({c["id"] for c in k_chunks}) == 1

    def per_choice(chunks: list[Any]) -> dict[int, int]:
        counts: dict[int, int] = {}
        for c in chunks:
            for choice in c["choices"]:
                counts[choice["index"]] = counts.get(choice["index"], 0) + 1
        return counts

    assert per_choice(k_chunks) == per_choice(e_chunks)
    usage = [c["usage"] for c in k_chunks if not c["choices"]]
    assert usage == [c["usage"] for c in e_chunks if not c["choices"]]


def test_tokenize_and_detokenize_answer_as_the_engine_does(vllm: EngineProcess) -> None:
    bodies = {
        "/tokenize": {"model": "tiny", "prompt": "hello there, general kenobi"},
        "/detokenize": {"model": "tiny", "tokens": [5, 6, 7, 8]},
    }

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        out = []
        for path, body in bodies.items():
            for base in (vllm.url, url):
                async with s.post(base + path, json=body) as r:
                    out.append((r.status, await r.json()))
        return out

    engine_tok, kvgate_tok, engine_detok, kvgate_detok = _through_kvgate(vllm, check)
    assert engine_tok == kvgate_tok and engine_tok[0] == 200 and engine_tok[1]["tokens"]
    assert engine_detok == kvgate_detok and engine_detok[0] == 200


def test_a_client_leaving_before_a_whole_answer_aborts_it_on_the_engine(
    vllm: EngineProcess,
) -> None:
    """The client leaves once the engine runs its request(s), whatever the machine's speed:
    the engine ends them at once (none runs to its length) and the books count them left."""
    body = {"model": "tiny", "prompt": "tell me everything", "max_tokens": 4000, "ignore_eos": True}

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        ran_out = _gauge(vllm.url, "vllm:request_success_total", 'finished_reason="length"')
        stopped_in = []
        for prompts in (1, 2):
            sent = {**body, "prompt": ["tell me", "everything"]} if prompts == 2 else body
            post = asyncio.create_task(_post(s, url, sent))
            for _ in range(200):  # until the engine runs them all (bounded: 20 s)
                await asyncio.sleep(0.1)
                if _gauge(vllm.url, "vllm:num_requests_running") >= prompts or post.done():
                    break
            assert not post.done(), post.result()  # 4,000 tokens must still be coming
            post.cancel()  # the client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await post
            polls = 0
            while polls < 40 and _gauge(vllm.url, "vllm:num_requests_running") > 0:
                await asyncio.sleep(0.1)
                polls += 1
            stopped_in.append(polls)
        for _ in range(50):  # the handlers close their books just after the engine stops
            if not gw.conductor.requests:
                break
            await asyncio.sleep(0.1)
        ran_out = (
            _gauge(vllm.url, "vllm:request_success_total", 'finished_reason="length"') - ran_out
        )
        outcomes = re.findall(
            r'^kvgate_requests_total{outcome="(\w+)"} (\S+)$', gw.metrics.render().decode(), re.M
        )
        return stopped_in, ran_out, dict(outcomes), len(gw.conductor.requests)

    stopped_in, ran_out, outcomes, books = _through_kvgate(vllm, check)
    assert max(stopped_in) < 40 and ran_out == 0, (stopped_in, ran_out)
    assert outcomes["client_disconnected"] == "3.0" and outcomes["completed"] == "0.0", outcomes
    assert books == 0


def test_a_burst_onto_an_idle_engine_runs_together_under_default_admission(
    vllm: EngineProcess,
) -> None:
    """Four requests at once onto an idle engine: the colocated prefill-stall check used to
    turn all but the first away (each waited in the decode queue for a decode to finish)."""

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        bodies = [
            {"model": "tiny", "prompt": f"request {i} " * 20, "max_tokens": 400, "stream": True}
            for i in range(4)
        ]
        sends = [asyncio.create_task(_post(s, url, {**b, "ignore_eos": True})) for b in bodies]
        most = 0.0
        while not all(t.done() for t in sends):
            most = max(most, _gauge(vllm.url, "vllm:num_requests_running"))
            await asyncio.sleep(0.05)
        return most, [t.result()[0] for t in sends], gw.settings.admission.mode.value

    most, statuses, mode = _through_kvgate(vllm, check, admission="predictive")
    assert mode == "predictive" and statuses == [200] * 4
    assert most == 4, most


RESPONSES_BODIES = {
    "text": {"instructions": "You are terse.", "input": "Weather in Paris? " * 20},
    "items": {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+2"}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "4"},
            {"role": "user", "content": "and 3+3?"},
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
    },
    "partial": {
        "input": [
            {"role": "user", "content": "Count to five."},
            {"type": "message", "role": "assistant", "status": "incomplete",
             "content": [{"type": "output_text", "text": "one two"}]},
        ]
    },
}  # fmt: skip


def test_responses_are_placed_by_the_prompt_the_engine_renders(vllm: EngineProcess) -> None:
    """kvgate's prompt for a Responses body is the engine's to the token (its ``input_tokens``),
    the answers through kvgate are the engine's, a stream's tokens are counted, and a follow-up
    continues a response made through kvgate."""

    async def check(url: str, s: aiohttp.ClientSession, gw: Any):
        out = {}
        route = ResponsesRoute(gw.specs)
        for name, extra in RESPONSES_BODIES.items():
            body = {"model": "tiny", "max_output_tokens": 4, "temperature": 0, **extra}
            head, _ = route.prompt(gw.parse_head(json.dumps(body).encode()))
            ours = gw.parse_prompt(CHAT, head, {}, f"probe-{name}").info.prompt_tokens
            answers = []
            for base in (vllm.url, url):
                async with s.post(base + "/v1/responses", json=body) as r:
                    answers.append((r.status, await r.json()))
            out[name] = (ours, answers)
        body = {"model": "tiny", "input": "Say something.", "max_output_tokens": 6, "stream": True}
        async with s.post(url + "/v1/responses", json=body) as r:
            stream = (r.status, (await r.read()).decode())
        made = out["text"][1][1][1]["id"]  # through kvgate
        again = {
            "model": "tiny",
            "input": "More.",
            "max_output_tokens": 3,
            "previous_response_id": made,
        }
        async with s.post(url + "/v1/responses", json=again) as r:
            follow = (r.status, await r.json())
        metrics = gw.metrics.render().decode()
        return out, stream, follow, metrics, len(gw.conductor.requests)

    out, (status, text), follow, metrics, books = _through_kvgate(vllm, check)
    for name, (ours, ((s1, direct), (s2, through))) in out.items():
        assert s1 == s2 == 200, (name, direct, through)
        assert ours == direct["usage"]["input_tokens"] == through["usage"]["input_tokens"], name
        assert direct.keys() == through.keys() and through["object"] == "response"
    events = [e for e in text.split("\n\n") if e.strip()]
    completed = json.loads(events[-1].split("data: ", 1)[1])["response"]
    deltas = sum(e.startswith("event: response.output_text.delta") for e in events)
    # an event carries one or more tokens (vLLM's detokenizer holds back partial words)
    assert status == 200 and 0 < deltas <= completed["usage"]["output_tokens"] == 6
    assert follow[0] == 200 and follow[1]["previous_response_id"] == out["text"][1][1][1]["id"]
    assert 'kvgate_requests_total{outcome="completed"} 5.0' in metrics  # 3 + stream + follow-up
    assert books == 0
