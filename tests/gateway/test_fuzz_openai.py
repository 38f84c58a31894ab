"""Fuzzing the OpenAI endpoints: schemathesis from GET /openapi.json, and hypothesis strategies
for hostile bodies and headers (odd Unicode, huge numbers, NaN, deep nesting, wrong types,
duplicated keys, non-JSON, enormous headers).

Every answer must be a success or a 4xx with an OpenAI error body, never a 5xx; no ERROR
record or traceback may reach the log; the gateway's books are back at zero after each run.
Engines: two emulators (prefill, decode) on 127.0.0.1:18101-18102. Seeds are fixed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from gateway.app import GatewayApp
from gateway.openai import parse_request
from routing.types import Decision
from tests.gateway.fuzz_strategies import FUZZ, HEADERS, HUGE_NUMBERS, ODD_TEXT, VALUES, Pairs, dump
from tests.gateway.fuzz_support import (
    Tally,
    assert_books_at_zero,
    assert_good_answer,
    assert_openai_error,
    fuzz_app,
    schemathesis_case_runner,
    trapped_logs,
)
from tests.tiny_model import write_model_dir

PORTS = (18101, 18102)
TALLY = Tally("openai")


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """Answers by status class over the whole module (``-s`` shows them)."""
    yield
    print(TALLY.report())


@pytest.fixture(scope="module")
def stack(report: None) -> Iterator[tuple[TestClient, GatewayApp]]:
    with fuzz_app(PORTS) as pair:
        yield pair


@pytest.fixture
def client(stack: tuple[TestClient, GatewayApp]) -> Iterator[TestClient]:
    """The client; afterwards no ERROR or traceback was logged and the books are at zero."""
    test_client, app = stack
    with trapped_logs() as trap:
        yield test_client
    assert trap.bad() == []
    assert_books_at_zero(app.gateway)


# ---------------------------------------------------------------- schemathesis
def test_openapi_is_served_and_valid(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/v1/chat/completions" in spec["paths"]
    schema = schemathesis.openapi.from_dict(spec)
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"} <= labels


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# (method, path, generation mode, examples); GETs take no input, so nothing to negate.
OPERATIONS = [
    ("POST", "/v1/completions", POSITIVE, 150),
    ("POST", "/v1/completions", NEGATIVE, 120),
    ("POST", "/v1/chat/completions", POSITIVE, 100),
    ("POST", "/v1/chat/completions", NEGATIVE, 80),
    ("GET", "/v1/models", POSITIVE, 5),
    ("GET", "/health", POSITIVE, 5),
    ("GET", "/openapi.json", POSITIVE, 5),
]


def bounded(spec: dict[str, Any]) -> dict[str, Any]:
    """The served description with array sizes bounded (at most 4 messages, 2 tool calls
    each): nested tool calls otherwise make generation cost 3x the requests' time."""
    messages = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]
    messages["maxItems"] = 4
    messages["items"]["properties"]["tool_calls"]["maxItems"] = 2
    return spec


@pytest.mark.parametrize(("method", "path", "mode", "examples"), OPERATIONS)
def test_schemathesis(
    client: TestClient, method: str, path: str, mode: GenerationMode, examples: int
) -> None:
    schema = schemathesis.openapi.from_dict(bounded(client.get("/openapi.json").json()))
    run = schemathesis_case_runner(client, TALLY)

    @seed(12)
    @settings(FUZZ, max_examples=examples)
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        run(case)

    fuzz()


# ---------------------------------------------------------------- hostile input by hand
TOKEN_IDS = st.lists(HUGE_NUMBERS | st.integers(0, 2**32 - 1), min_size=0, max_size=6)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_text"]) | VALUES},
    optional={"text": ODD_TEXT | VALUES},
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | VALUES},
    optional={
        "content": ODD_TEXT | st.lists(PART | ODD_TEXT, max_size=3) | VALUES,
        "tool_calls": VALUES,
        "name": ODD_TEXT | VALUES,
    },
)
FIELDS = {
    "model": ODD_TEXT | VALUES,
    "prompt": ODD_TEXT | TOKEN_IDS | st.lists(ODD_TEXT | TOKEN_IDS, max_size=3) | VALUES,
    "messages": st.lists(MESSAGE | VALUES, max_size=3) | VALUES,
    "max_tokens": HUGE_NUMBERS | VALUES,
    "max_completion_tokens": HUGE_NUMBERS | VALUES,
    "stream": st.booleans() | VALUES,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | VALUES}) | VALUES,
    "temperature": HUGE_NUMBERS,
    "n": HUGE_NUMBERS,
    "cache_salt": ODD_TEXT | VALUES,
    "add_special_tokens": st.booleans() | VALUES,
    "tools": VALUES,
}


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A request body: mostly a JSON object of the fields kvgate reads (odd values, wrong
    types, repeated keys), sometimes not a JSON object at all."""
    kind = draw(st.sampled_from(["object"] * 6 + ["deep", "junk", "value"]))
    if kind == "deep":
        depth = draw(st.sampled_from([50, 900, 5000, 200_000]))
        inner = b'"x"'
        wrap = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nested = wrap[0] * depth + inner + wrap[1] * depth
        return b'{"prompt":' + nested + b', "messages":' + nested + b"}"
    if kind == "junk":
        return draw(
            st.sampled_from([b"", b"{", b"nul", b"\xff\xfe{}", b'{"prompt": "a"', b"\x00" * 10])
            | st.binary(max_size=64)
        )
    if kind == "value":
        return dump(draw(VALUES))
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=0, max_size=6))
    pairs = Pairs((k, draw(FIELDS[k])) for k in keys)  # a key drawn twice repeats
    if draw(st.booleans()):  # usually something the gateway would accept, to reach the engine
        pairs.insert(0, ("prompt", "hello world"))
        pairs.insert(0, ("messages", [{"role": "user", "content": "hi"}]))
        pairs.insert(0, ("max_tokens", 2))
    return dump(pairs, ascii=draw(st.booleans()))


@seed(1212)
@settings(FUZZ, max_examples=500)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=bodies(),
    headers=HEADERS,
)
def test_hostile_bodies_and_headers(
    client: TestClient, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    response = client.post(path, content=body, headers=headers)
    TALLY.add(response.status_code)
    assert_good_answer(response)


def test_issue_12_lone_surrogate_prompt(client: TestClient) -> None:
    for path, body in (
        ("/v1/completions", b'{"prompt": "\\u0000\\ud800", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        # the surrogate's own bytes, which json.loads decodes with "surrogatepass"
        ("/v1/completions", '{"prompt": "a\ud800"}'.encode("utf-8", "surrogatepass")),
        ("/v1/completions", '{"prompt": "a\ud800"}'.encode("utf-16", "surrogatepass")),
    ):
        r = client.post(path, content=body)
        assert_openai_error(r)
        assert r.status_code == 400
    # A valid escaped pair (what json.dumps writes for an emoji) is fine.
    r = client.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deep_nesting_is_a_400(client: TestClient, depth: int) -> None:
    r = client.post("/v1/completions", content=b'{"prompt":' + b"[" * depth + b"]" * depth + b"}")
    assert_openai_error(r)


@pytest.mark.parametrize("name", ["x-slo-ttft-ms", "x-slo-tbt-ms"])
@pytest.mark.parametrize("value", ["inf", "Infinity", "1e309", "nan", "-1", "abc"])
def test_slo_headers_must_be_finite_positive(client: TestClient, name: str, value: str) -> None:
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={name: value}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == name


def test_enormous_headers_and_body(client: TestClient) -> None:
    big = {"x-request-id": "r" * 60_000, "x-unknown": "u" * 200_000}
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=big)
    assert_good_answer(r)
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 300_000 + b'"}')
    assert r.status_code == 413
    assert_openai_error(r)


def test_unknown_paths_and_methods_are_openai_errors(client: TestClient) -> None:
    for method, path in (("GET", "/nope"), ("PUT", "/v1/models"), ("GET", "/v1/completions")):
        r = client.request(method, path)
        assert_openai_error(r)


def test_one_client_request_id_on_concurrent_requests(
    client: TestClient, stack: tuple[TestClient, GatewayApp]
) -> None:
    """Clients reuse ids: requests in flight at once under one X-Request-Id keep their own
    books (the books are keyed by request id)."""
    import asyncio

    import httpx2

    app = stack[1]
    headers = {"x-request-id": "same-id"}

    async def together() -> list[int]:
        transport = httpx2.ASGITransport(app=app)  # the running app, in its own loop
        async with httpx2.AsyncClient(transport=transport, base_url="http://testserver") as c:
            body = {"prompt": "shared id " * 20, "max_tokens": 8, "stream": True}
            answers = await asyncio.gather(
                *(c.post("/v1/completions", json=body, headers=headers) for _ in range(4))
            )
        return [r.status_code for r in answers]

    assert client.portal is not None
    assert client.portal.call(together) == [200] * 4


def test_the_books_check_sees_a_request_left_in_flight(
    client: TestClient, stack: tuple[TestClient, GatewayApp]
) -> None:
    gw = stack[1].gateway
    now = gw.clock()
    parsed = parse_request(
        "/v1/completions",
        b'{"prompt": "left behind", "max_tokens": 2}',
        {},
        "leak-1",
        now,
        settings=gw.settings,
        encoder=gw.prompt_encoder,
        hasher=gw.hasher,
        models=gw.model_routes,
    )
    decision = gw.conductor.schedule(parsed.info, now, frozenset())
    assert isinstance(decision, Decision)
    gw.conductor.dispatched(decision, parsed.info, now)
    with pytest.raises(AssertionError, match="leak-1"):
        assert_books_at_zero(gw)
    gw.conductor.failed("leak-1", gw.clock())  # and the fixture sees the books at zero again


# ---------------------------------------------------------------- engine-exact prompts
@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory, report: None) -> Iterator[TestClient]:
    """A fleet whose gateway and engines tokenize with a model directory (tokenizers' BPE and
    a Jinja chat template): other code, other failure modes than the approximate encoder."""
    model_dir = write_model_dir(tmp_path_factory.mktemp("tiny-model"))
    with fuzz_app(EXACT_PORTS, str(model_dir)) as (test_client, app):
        with trapped_logs() as trap:
            yield test_client
        assert trap.bad() == []
        assert_books_at_zero(app.gateway)


EXACT_PORTS = (18103, 18104)
EXACT_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "chat_template_kwargs": VALUES,
        "add_generation_prompt": st.booleans() | VALUES,
        "continue_final_message": st.booleans() | VALUES,
        "documents": VALUES,
        "reasoning_effort": VALUES,
        "tools": st.lists(
            st.fixed_dictionaries(
                {"type": st.just("function"), "function": st.fixed_dictionaries({"name": ODD_TEXT})}
            ),
            max_size=2,
        )
        | VALUES,
    },
)


@seed(1213)
@settings(FUZZ, max_examples=200)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=bodies(),
    extra=EXACT_FIELDS,
)
def test_hostile_bodies_engine_exact(
    exact: TestClient, path: str, body: bytes, extra: dict
) -> None:
    """The same hostile bodies, plus the chat template's own fields, through the exact encoder."""
    if extra and body.startswith(b"{") and body.endswith(b"}") and len(body) > 2:
        body = body[:-1] + b"," + dump(extra)[1:]  # the template fields join the object
    response = exact.post(path, content=body)
    TALLY.add(response.status_code)
    assert_good_answer(response)


def test_engine_exact_lone_surrogate_and_a_good_chat(exact: TestClient) -> None:
    r = exact.post(
        "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
    )
    assert r.status_code == 400
    assert_openai_error(r)
    r = exact.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
