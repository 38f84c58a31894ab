"""Several models behind one gateway: the request's ``model`` picks its engines, never others'."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from starlette.testclient import TestClient

from config.loader import settings_from_dict
from config.settings import PDProtocol, Role
from gateway.app import build_app
from gateway.openai import COMPLETIONS
from replay.emulator.config import EmulatorConfig
from replay.emulator.server import RunningEmulator, start_emulator


@pytest.fixture(scope="module")
def engines() -> Iterator[list[RunningEmulator]]:
    """Three colocated emulators on a loop of their own: two serve "alpha", one "beta"."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    # As vLLM would serve them: alpha also as "a" (--served-model-name alpha a), with the
    # adapters the tests below name (--lora-modules).
    names = (("alpha", "a"), ("alpha", "a"), ("beta",))
    adapters = (("alpha-sql", "/lora/alpha-sql"), ("sql", "/lora/sql"))
    emus = [
        run(
            start_emulator(
                EmulatorConfig(
                    role=Role.BOTH,
                    protocol=PDProtocol.VLLM,
                    time_scale=0.02,
                    model=name[0],
                    model_aliases=name[1:],
                    lora_adapters=adapters,
                )
            )
        )
        for name in names
    ]
    try:
        yield emus
    finally:
        for e in emus:
            run(e.stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _settings(engines: list[RunningEmulator], with_models: bool = True):
    pools = [
        {
            "name": "alpha-pool",
            "role": "both",
            "instances": [
                {"id": "a0", "url": engines[0].url, "protocol": "vllm"},
                {"id": "a1", "url": engines[1].url, "protocol": "vllm"},
            ],
        },
        {
            "name": "beta-pool",
            "role": "both",
            "instances": [{"id": "b0", "url": engines[2].url, "protocol": "vllm"}],
        },
    ]
    models = [
        {"name": "alpha", "pools": ["alpha-pool"], "aliases": ["a"]},
        {"name": "beta", "pools": ["beta-pool"], "ttft_s": 20.0},
    ]
    data: dict[str, Any] = {
        "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
        "admission": {"mode": "none"},
        "pools": pools,
    }
    if with_models:
        data["models"] = models
    return settings_from_dict(data)


def _chat(model: str, text: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_each_request_reaches_only_its_models_engines(engines: list[RunningEmulator]) -> None:
    with TestClient(build_app(_settings(engines))) as client:
        seen: dict[str, set[str]] = {"alpha": set(), "a": set(), "beta": set()}
        for k in range(12):
            for model in seen:
                r = client.post("/v1/chat/completions", json=_chat(model, f"hello {k} " * 40))
                assert r.status_code == 200, r.text
                seen[model].add(r.headers["x-kvgate-prefill"])
        assert seen["alpha"] | seen["a"] <= {"a0", "a1"}
        assert seen["beta"] == {"b0"}
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["alpha", "a", "beta"]
        text = client.get("/metrics").text
        assert 'kvgate_model_requests_total{model="alpha",outcome="completed"} 24.0' in text
        assert 'kvgate_model_requests_total{model="beta",outcome="completed"} 12.0' in text


def test_unknown_model_is_404_model_not_found(engines: list[RunningEmulator]) -> None:
    with TestClient(build_app(_settings(engines))) as client:
        r = client.post("/v1/completions", json={"model": "gamma", "prompt": "hi"})
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "gamma" in err["message"] and err["type"] == "invalid_request_error"
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert client.app.gateway.conductor.requests == {}


def test_without_models_table_v1_models_lists_the_engines_models(
    engines: list[RunningEmulator],
) -> None:
    with TestClient(build_app(_settings(engines, with_models=False))) as client:
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["a", "alpha", "alpha-sql", "beta", "sql"]  # names and adapters
        # Single-model configs keep ignoring ``model`` for routing, as before: the request is
        # placed and forwarded, and the engine answers for a name it does not serve.
        r = client.post("/v1/completions", json={"model": "whatever", "prompt": "hi " * 30})
        err = r.json()["error"]  # the engine's answer, not kvgate's model_not_found
        assert r.status_code == 404 and err["code"] == 404, err
        assert err["message"] == "The model `whatever` does not exist."


def _keys(gw: Any, model: Any, text: str) -> tuple[int, ...]:
    raw = json.dumps({"model": model, "prompt": text}).encode()
    return gw.parse_prompt(COMPLETIONS, gw.parse_head(raw), {}, "probe").info.block_hashes


def test_a_lora_adapter_goes_to_its_base_models_engines_in_its_own_key_space(
    engines: list[RunningEmulator],
) -> None:
    settings = _settings(engines)
    alpha = replace(settings.models[0], lora_adapters=("alpha-sql",))
    with TestClient(build_app(replace(settings, models=(alpha, settings.models[1])))) as client:
        gw = client.app.gateway
        text = "select the rows that hold the prefix " * 20
        base, adapter = _keys(gw, "alpha", text), _keys(gw, "alpha-sql", text)
        route = gw.model_routes["alpha-sql"]
        assert route.name == "alpha" and route.lora == "alpha-sql"
        assert len(base) == len(adapter) > 10 and not set(base) & set(adapter)
        root = route.hasher.namespace_root("alpha-sql", None)
        packed = gw.prompt_encoder.encode(COMPLETIONS, {"prompt": text}).packed
        assert adapter == route.hasher.hash_packed(packed, root)  # the engine events' keys
        for _ in range(6):
            r = client.post("/v1/chat/completions", json=_chat("alpha-sql", text))
            assert r.status_code == 200 and r.headers["x-kvgate-prefill"] in {"a0", "a1"}
        assert "alpha-sql" in [m["id"] for m in client.get("/v1/models").json()["data"]]


def test_without_a_models_table_routing_lora_adapters_key_adapters_apart(
    engines: list[RunningEmulator],
) -> None:
    settings = _settings(engines, with_models=False)
    settings = replace(settings, routing=replace(settings.routing, lora_adapters=("sql",)))
    with TestClient(build_app(settings)) as client:
        gw = client.app.gateway
        text = "select the rows that hold the prefix " * 20
        plain = _keys(gw, "whatever", text)
        assert _keys(gw, None, text) == plain  # any other model (or none): the one model
        assert _keys(gw, ["not", "a", "name"], text) == plain
        assert not set(_keys(gw, "sql", text)) & set(plain)
        r = client.post("/v1/completions", json={"model": "sql", "prompt": text})
        assert r.status_code == 200, r.text
