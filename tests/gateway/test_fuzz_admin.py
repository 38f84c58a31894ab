"""Fuzzing the admin API: schemathesis from GET /admin/openapi.json (with and without the
bearer token), and hypothesis strategies for hostile bodies to the endpoints that change state.

Every answer must be a success or a 4xx with an OpenAI error body; no ERROR record or
traceback in the log; the books at zero. A fresh app per module, and after every example the
configuration, instances and drain flags are put back, so one example's change cannot leak
into the next (or into other test modules). Engines: emulators on 127.0.0.1:18121-18122.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from gateway.admin_openapi import OPENAPI
from gateway.app import GatewayApp
from tests.gateway.fuzz_strategies import FUZZ, HEADERS, VALUES, Pairs, dump
from tests.gateway.fuzz_support import (
    AUTH,
    Tally,
    assert_books_at_zero,
    assert_good_answer,
    fuzz_app,
    schemathesis_case_runner,
    trapped_logs,
)

PORTS = (18121, 18122)
TALLY = Tally("admin")
# Positive examples add instances only on loopback in this suite's port range (never a port
# or host the fuzzer made up); negative ones are refused by validation before anything is added.
LOOPBACK_URL = {"type": "string", "pattern": "^http://127\\.0\\.0\\.1:181[2-9][0-9]$"}


def fuzz_spec() -> dict[str, Any]:
    spec = copy.deepcopy(OPENAPI)
    body = spec["paths"]["/admin/instances"]["post"]["requestBody"]
    body["content"]["application/json"]["schema"]["properties"]["url"] = LOOPBACK_URL
    return spec


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    """Answers by status class over the whole module (``-s`` shows them)."""
    yield
    print(TALLY.report())


@pytest.fixture(scope="module")
def stack(report: None) -> Iterator[tuple[TestClient, GatewayApp]]:
    with fuzz_app(PORTS) as pair:
        yield pair


class Restore:
    """Puts the gateway's configuration, instances and drain flags back as they were."""

    def __init__(self, app: GatewayApp) -> None:
        self.gw = app.gateway
        self.settings = self.gw.settings
        self.ids = set(self.gw.conductor.instances)

    def __call__(self) -> None:
        gw = self.gw
        for iid in set(gw.conductor.instances) - self.ids:
            gw.remove_instance(iid)
        for iid in self.ids:
            gw.conductor.drain_instance(iid, False)
        gw.apply_settings(self.settings)


@pytest.fixture
def client(stack: tuple[TestClient, GatewayApp]) -> Iterator[tuple[TestClient, Restore]]:
    test_client, app = stack
    restore = Restore(app)
    with trapped_logs() as trap:
        yield test_client, restore
    restore()
    assert trap.bad() == []
    assert_books_at_zero(app.gateway)
    assert set(app.gateway.conductor.instances) == restore.ids


def _operations() -> list[tuple[str, str]]:
    return [
        (method.upper(), path)
        for path, ops in OPENAPI["paths"].items()
        for method in ops
        if method in ("get", "put", "post", "delete")
    ]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize(("method", "path"), _operations())
def test_schemathesis(
    client: tuple[TestClient, Restore], method: str, path: str, mode: GenerationMode
) -> None:
    test_client, restore = client
    op = schemathesis.openapi.from_dict(fuzz_spec())[path][method]
    if mode is GenerationMode.NEGATIVE and not (op.body or op.path_parameters or op.query):
        pytest.skip("no input to negate")
    with_token = schemathesis_case_runner(test_client, TALLY, headers=AUTH)
    without = schemathesis_case_runner(test_client, TALLY)
    examples = 80 if method in ("PUT", "POST") else 10

    @seed(21)
    @settings(FUZZ, max_examples=examples)
    @given(case=op.as_strategy(generation_mode=mode), authorized=st.booleans())
    def fuzz(case: Any, authorized: bool) -> None:
        try:
            (with_token if authorized else without)(case)
        finally:
            restore()

    fuzz()


SECTIONS = ["/admin/slo", "/admin/routing", "/admin/admission", "/admin/replication/settings"]
KNOWN_KEYS = st.sampled_from(
    ["ttft_s", "tbt_s", "priorities", "policy", "params", "mode", "margin", "block_size",
     "enabled", "sink", "max_replicas", "id", "url", "role", "protocol", "draining"]
)  # fmt: skip


@st.composite
def admin_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["object"] * 4 + ["deep", "junk", "value"]))
    if kind == "deep":
        depth = draw(st.sampled_from([100, 5000, 200_000]))
        return b'{"ttft_s":' + b"[" * depth + b"]" * depth + b"}"
    if kind == "junk":
        return draw(
            st.sampled_from([b"", b"{", b"\xff\xfe", b"null", b"[]"]) | st.binary(max_size=32)
        )
    if kind == "value":
        return dump(draw(VALUES))
    keys = draw(st.lists(KNOWN_KEYS, max_size=5))
    return dump(Pairs((k, draw(VALUES)) for k in keys), ascii=draw(st.booleans()))


@seed(2121)
@settings(FUZZ, max_examples=300)
@given(
    target=st.sampled_from(
        [("PUT", p) for p in SECTIONS]
        + [("POST", "/admin/instances"), ("POST", "/admin/instances/p0/drain")]
    ),
    body=admin_bodies(),
    headers=HEADERS,
)
def test_hostile_admin_bodies(
    client: tuple[TestClient, Restore],
    target: tuple[str, str],
    body: bytes,
    headers: list[tuple[bytes, bytes]],
) -> None:
    test_client, restore = client
    method, path = target
    try:
        r = test_client.request(method, path, content=body, headers=[*_auth(), *headers])
        TALLY.add(r.status_code)
        assert_good_answer(r)
    finally:
        restore()


def _auth() -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in AUTH.items()]


def test_the_fleet_still_serves_after_the_fuzz(client: tuple[TestClient, Restore]) -> None:
    test_client, _ = client
    r = test_client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text
    state = test_client.get("/admin/state", headers=AUTH).json()
    assert state["requests_in_flight"] == 0
    assert sorted(i["id"] for i in state["instances"]) == ["d0", "p0"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # A lone surrogate echoed in the error message could not be encoded (was a 500).
        ("/admin/slo", b'{"ttft_s": "\\ud800"}'),
        ("/admin/slo", b'{"\\ud800": 1}'),
        (
            "/admin/slo",
            '{"priorities": [{"name": "\ud800", "level": 5}]}'.encode("utf-8", "surrogatepass"),
        ),
        ("/admin/routing", b'{"params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ],
)
def test_admin_refuses_what_it_cannot_read(
    client: tuple[TestClient, Restore], path: str, body: bytes
) -> None:
    test_client, _ = client
    r = test_client.put(path, content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert_good_answer(r)
