"""gateway/app.py: which handler answers what, OpenAI-shaped errors for unknown paths and wrong
methods, /health as load balancers read it, and a lifespan whose startup failure is reported
(not a traceback). No lifespan runs here except where a test drives it: no engine is needed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

from config.loader import settings_from_dict
from gateway.app import GatewayApp, build_app
from gateway.openai_openapi import OPENAPI

FLEET = {
    "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
    "pools": [
        {"name": "both", "role": "both", "instances": [{"id": "c0", "url": "http://127.0.0.1:9"}]}
    ],
}


@pytest.fixture
def app() -> GatewayApp:
    return build_app(settings_from_dict(FLEET))


def _is_openai_error(body: Any, kind: str) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and err["type"] == kind
        and bool(err["message"])
    )


def test_completions_take_post_only(app: GatewayApp) -> None:
    client = TestClient(app)
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.get(path)
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert _is_openai_error(r.json(), "invalid_request_error")


def test_unknown_paths_and_wrong_methods_answer_in_openais_error_shape(app: GatewayApp) -> None:
    client = TestClient(app)
    r = client.get("/v1/nope")
    assert r.status_code == 404 and _is_openai_error(r.json(), "not_found_error")
    r = client.post("/health")
    assert r.status_code == 405 and _is_openai_error(r.json(), "invalid_request_error")


def test_health_follows_the_instances_and_the_drain(app: GatewayApp) -> None:
    client = TestClient(app)
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "instances": {"c0": True}}
    app.gateway.conductor.set_health("c0", False)
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "no healthy instance"
    app.gateway.conductor.set_health("c0", True)
    app.gateway.drain.draining = True  # SIGTERM: load balancers must stop sending here
    r = client.get("/health")
    assert r.status_code == 503 and r.json() == {"status": "shutting down"}


def test_openapi_and_metrics_are_served(app: GatewayApp) -> None:
    client = TestClient(app)
    assert client.get("/openapi.json").json() == OPENAPI
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def test_a_failed_startup_is_reported_through_the_lifespan(
    app: GatewayApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken() -> None:
        raise RuntimeError("engines unreachable")

    monkeypatch.setattr(app.gateway, "startup", broken)
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "lifespan"}, receive, send))
    assert sent == [{"type": "lifespan.startup.failed", "message": "engines unreachable"}]
