"""Admin REST: auth, live changes validated like the config file, instances, inspection."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from config.loader import settings_from_dict
from gateway.app import build_app

TOKEN = "s3cret-token"
BASE = {
    "server": {"admin_token": TOKEN, "health_interval_s": 30.0, "refit_interval_s": 0},
    "admission": {"mode": "early"},
    "pools": [
        {
            "name": "prefill",
            "role": "prefill",
            "instances": [{"id": "p0", "url": "http://127.0.0.1:9"}],
        },
        {
            "name": "decode",
            "role": "decode",
            "instances": [{"id": "d0", "url": "http://127.0.0.1:8"}],
        },
    ],
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = build_app(settings_from_dict(BASE))
    with TestClient(app) as c:
        yield c


def test_requires_the_bearer_token(client: TestClient) -> None:
    assert client.get("/admin/slo").status_code == 401
    r = client.get("/admin/slo", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert client.get("/admin/slo", headers=AUTH).status_code == 200


def test_disabled_without_a_configured_token() -> None:
    data = {**BASE, "server": {"health_interval_s": 30.0}}
    with TestClient(build_app(settings_from_dict(data))) as c:
        r = c.get("/admin/state", headers={"Authorization": "Bearer "})
        assert r.status_code == 401 and "disabled" in r.json()["error"]["message"]


def test_put_slo_applies_live_and_is_validated(client: TestClient) -> None:
    r = client.put("/admin/slo", json={"ttft_s": 2.5}, headers=AUTH)
    assert r.status_code == 200 and r.json()["ttft_s"] == 2.5
    assert client.app.gateway.conductor.settings.slo.ttft_s == 2.5
    bad = client.put("/admin/slo", json={"ttft_s": -1}, headers=AUTH)
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert "slo.ttft_s" in err["message"] and err["param"] == "slo.ttft_s"
    assert client.app.gateway.settings.slo.ttft_s == 2.5  # unchanged by the bad request
    typo = client.put("/admin/slo", json={"ttft": 1}, headers=AUTH)
    assert typo.status_code == 400 and "ttft_s" in typo.json()["error"]["message"]


def test_put_policy_and_admission(client: TestClient) -> None:
    r = client.put("/admin/routing", json={"policy": "least_load"}, headers=AUTH)
    assert r.status_code == 200
    assert client.app.gateway.conductor.policy.name == "least_load"
    r = client.put("/admin/routing", json={"policy": "nope"}, headers=AUTH)
    assert r.status_code == 400 and "unknown policy" in r.json()["error"]["message"]
    r = client.put(
        "/admin/routing",
        json={"policy": "sglang_cache_aware", "params": {"cache_threshold": "x"}},
        headers=AUTH,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "routing.params.cache_threshold"
    r = client.put("/admin/admission", json={"mode": "predictive"}, headers=AUTH)
    assert r.json()["mode"] == "predictive"
    assert client.app.gateway.conductor.admission.mode.value == "predictive"


def test_instances_add_drain_delete(client: TestClient) -> None:
    r = client.post(
        "/admin/instances",
        headers=AUTH,
        json={"id": "p1", "url": "http://127.0.0.1:10", "role": "prefill"},
    )
    assert r.status_code == 201 and r.json()["id"] == "p1"
    ids = [i["id"] for i in client.get("/admin/instances", headers=AUTH).json()]
    assert ids == ["p0", "d0", "p1"]
    dup = client.post(
        "/admin/instances",
        headers=AUTH,
        json={"id": "p1", "url": "http://127.0.0.1:11", "role": "prefill"},
    )
    assert dup.status_code == 400 and "p1" in dup.json()["error"]["message"]
    bad = client.post(
        "/admin/instances", headers=AUTH, json={"id": "p2", "url": "ftp://x", "role": "prefill"}
    )
    assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
    r = client.post("/admin/instances/p1/drain", headers=AUTH)
    assert r.json()["draining"] is True
    r = client.post("/admin/instances/p1/drain", headers=AUTH, json={"draining": False})
    assert r.json()["draining"] is False
    assert client.delete("/admin/instances/p1", headers=AUTH).json()["removed"] == "p1"
    assert client.delete("/admin/instances/p1", headers=AUTH).status_code == 404


def test_state_decisions_predictors_replication_openapi(client: TestClient) -> None:
    state = client.get("/admin/state", headers=AUTH).json()
    assert state["policy"] == "kvcache_centric" and len(state["instances"]) == 2
    assert state["best_effort_admitted"] == 0  # nothing served yet
    assert state["decode_reservation"] == {"pressure": {}, "turned_away": 0}
    assert state["tbt_headroom_share"] == {} and state["decode_rebinds"] == 0
    assert state["wait_margin"] == {}  # no request admitted yet
    assert state["stall_credit"] == {}  # no colocated decode finished yet
    assert state["prompt_identity"][""]["exact"] is False  # no model_dir: approximate
    inst = state["instances"][0]
    for key in (
        "queue_s",
        "predicted_ttft_1k_tokens_s",
        "decode_batch",
        "cache_view_blocks",
        "healthy",
        "circuit",
    ):
        assert key in inst
    assert client.get("/admin/decisions?limit=5", headers=AUTH).json() == []
    assert client.get("/admin/decisions?limit=x", headers=AUTH).status_code == 400
    assert "ttft_mape_pct" in client.get("/admin/predictors", headers=AUTH).json()
    assert client.get("/admin/replication", headers=AUTH).json()["issued"] == 0
    spec = client.get("/admin/openapi.json").json()
    assert spec["openapi"].startswith("3.") and "/admin/slo" in spec["paths"]


def test_public_endpoints(client: TestClient) -> None:
    assert client.get("/v1/models").json()["object"] == "list"
    metrics = client.get("/metrics").text
    assert "kvgate_requests" in metrics and "kvgate_decision_seconds" in metrics
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"x-kvgate-priority": "vip"})
    assert r.status_code == 400 and "vip" in r.json()["error"]["message"]
    assert client.get("/v1/completions").status_code == 405


def test_macro_instances_endpoint() -> None:
    data = {
        "server": {"admin_token": TOKEN, "health_interval_s": 30.0, "refit_interval_s": 0},
        "routing": {"policy": "rolling_activation"},
        "pools": [
            {
                "name": "both",
                "role": "both",
                "instances": [
                    {"id": f"c{i}", "url": f"http://127.0.0.1:{20 + i}"} for i in range(4)
                ],
            }
        ],
    }
    # No lifespan: no health checks mark the (unreachable) instances down.
    body = (
        TestClient(build_app(settings_from_dict(data)))
        .get("/admin/macro-instances", headers=AUTH)
        .json()
    )
    assert body["policy"] == "rolling_activation"
    members = [
        m["id"] if isinstance(m, dict) else m
        for macro in body["macro_instances"]
        for m in macro["members"]
    ]
    assert sorted(members) == ["c0", "c1", "c2", "c3"]
    with TestClient(build_app(settings_from_dict(BASE))) as c:
        assert c.get("/admin/macro-instances", headers=AUTH).status_code == 404
