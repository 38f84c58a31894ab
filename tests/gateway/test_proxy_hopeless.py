"""The proxy's hopeless path: a request whose best case misses its TTFT SLO is rejected before
its prompt is tokenized, with the answer, metrics and books of a ``ttft_slo`` rejection."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from config.loader import settings_from_dict
from gateway.app import build_app

PROMPT = {"prompt": "hello " * 200, "max_tokens": 4}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingEncoder:
    """The gateway's encoder, counting the prompts it tokenizes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self.exact = inner.exact

    def encode(self, path: str, body: Any) -> Any:
        self.calls += 1
        return self.inner.encode(path, body)

    def prepare(self, path: str, body: Any, min_chars: int) -> Any:
        return self.inner.prepare(path, body, min_chars)

    def accept(self, work: Any, results: list[bytes]) -> None:
        self.inner.accept(work, results)

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


def _settings(mode: str = "early", **extra: Any):
    return settings_from_dict(
        {
            "slo": {"ttft_s": 1.0},
            "admission": {"mode": mode},
            "server": {"admin_token": "adm", "health_interval_s": 30.0, "refit_interval_s": 0},
            # Never listened on: a request that is placed fails to connect (502/503).
            "pools": [
                {
                    "name": "w",
                    "role": "both",
                    "instances": [
                        {"id": "w0", "url": "http://127.0.0.1:9"},
                        {"id": "w1", "url": "http://127.0.0.1:7"},
                    ],
                }
            ],
            **extra,
        }
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _client(clock: FakeClock, **kw: Any) -> Iterator[tuple[TestClient, Any, CountingEncoder]]:
    app = build_app(_settings(**kw), clock=clock)
    with TestClient(app) as c:
        gw = app.gateway
        enc = CountingEncoder(gw.prompt_encoder)
        gw.prompt_encoder = enc
        yield c, gw, enc


def _queue(gw: Any, seconds: dict[str, float], now: float) -> None:
    # Nothing listens: wait for the first health round to find both down (the next one is
    # 30 s away), then call them healthy, so that the queues decide.
    deadline = time.monotonic() + 10.0
    while any(i.healthy for i in gw.conductor.instances.values()):
        assert time.monotonic() < deadline, "the first health round did not run"
        time.sleep(0.01)
    for iid in ("w0", "w1"):
        gw.conductor.set_health(iid, True)
    for iid, s in seconds.items():
        gw.conductor.instances[iid].enqueue_prefill(f"filler-{iid}", s, 1024, now, now)


def test_hopeless_request_is_rejected_without_tokenizing(clock: FakeClock) -> None:
    for c, gw, enc in _client(clock):
        _queue(gw, {"w0": 3.0, "w1": 2.0}, clock.now)
        r = c.post("/v1/completions", json=PROMPT, headers={"x-slo-ttft-ms": "500"})
        assert r.status_code == 429, r.text
        assert r.headers["x-kvgate-reject-reason"] == "ttft_slo"
        assert r.headers["x-kvgate-predicted-ttft-ms"] == "2000.0"
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-request-id"]
        err = r.json()["error"]
        assert err["code"] == "ttft_slo" and err["type"] == "rate_limit_exceeded"
        assert enc.calls == 0  # the prompt was never tokenized
        assert gw.conductor.stats.rejections == {"ttft_slo": 1}
        assert gw.conductor.requests == {}
        metrics = gw.metrics.render().decode()
        assert 'kvgate_rejections_total{priority="normal",reason="ttft_slo"} 1.0' in metrics
        assert 'kvgate_requests_total{outcome="rejected"} 1.0' in metrics
        state = c.get("/admin/state", headers={"Authorization": "Bearer adm"}).json()
        assert state["rejections"] == {"ttft_slo": 1} and state["decisions"] == 0
        # Chat too: the same rejection before the messages are rendered.
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi " * 300}], "max_tokens": 4},
            headers={"x-slo-ttft-ms": "500"},
        )
        assert r.status_code == 429 and r.headers["x-kvgate-reject-reason"] == "ttft_slo"
        assert enc.calls == 0


def test_a_short_queue_takes_the_full_path(clock: FakeClock) -> None:
    for c, gw, enc in _client(clock):
        _queue(gw, {"w0": 3.0}, clock.now)  # w1 is idle
        r = c.post("/v1/completions", json=PROMPT, headers={"x-slo-ttft-ms": "500"})
        assert enc.calls == 1
        # Placed on w1 (where nothing listens): an engine error, not an admission rejection.
        assert "x-kvgate-reject-reason" not in r.headers and r.status_code in (502, 503)


def test_bad_requests_are_still_400(clock: FakeClock) -> None:
    for c, gw, _enc in _client(clock):
        _queue(gw, {"w0": 3.0, "w1": 3.0}, clock.now)
        cases = [
            ({"max_tokens": 4}, {}),  # no prompt
            (PROMPT, {"x-kvgate-priority": "nope"}),
            (PROMPT, {"x-slo-ttft-ms": "-1"}),
            ({**PROMPT, "stream": "yes"}, {}),
        ]
        for body, headers in cases:
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 400, (body, headers, r.text)
        assert c.post("/v1/completions", content=b"{not json").status_code == 400
        assert gw.conductor.stats.rejections == {}


def test_off_without_slo_admission_and_with_tenants(clock: FakeClock) -> None:
    for c, gw, enc in _client(clock, mode="none"):
        _queue(gw, {"w0": 30.0, "w1": 30.0}, clock.now)
        r = c.post("/v1/completions", json=PROMPT, headers={"x-slo-ttft-ms": "500"})
        assert r.status_code != 429 and enc.calls == 1
    tenants = {
        "enabled": True,
        "require_key": False,
        "default_tenant": "t",
        "tenant": [{"name": "t"}],
    }
    for c, gw, enc in _client(clock, tenants=tenants):
        _queue(gw, {"w0": 30.0, "w1": 30.0}, clock.now)
        r = c.post("/v1/completions", json=PROMPT, headers={"x-slo-ttft-ms": "500"})
        # Rejected by the full path: tenants' buckets and shares need the prompt's tokens.
        assert r.status_code == 429 and r.headers["x-kvgate-reject-reason"] == "ttft_slo"
        assert enc.calls == 1
