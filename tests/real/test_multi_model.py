"""Two models behind one gateway, each on its own real engine: a vLLM model (engine-exact
prompt identity from its model directory) and a llama.cpp model. Every request reaches only its
own model's engine, the engines' own counters agree, an unknown model is a 404."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from config.loader import settings_from_dict
from config.settings import Settings
from gateway.app import build_app
from tests.real.conftest import EngineInstall
from tests.real.engines import (
    EngineProcess,
    free_ports,
    start_llama_server,
    start_vllm,
    stop_engine,
)

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def engines(
    vllm_install: EngineInstall, llamacpp_install: EngineInstall
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    vport, lport = free_ports(2, 18060, 18099)
    vllm = start_vllm(vport, extra_args=["--served-model-name", "vllm-tiny"])
    try:
        llama = start_llama_server(lport, extra_args=["--alias", "llama-tiny"])
    except BaseException:
        stop_engine(vllm)
        raise
    yield vllm, llama
    stop_engine(llama)
    stop_engine(vllm)


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


def _two_models(vllm: EngineProcess, llama: EngineProcess) -> Settings:
    """One gateway, two models: vLLM's (its own tokenizer) and llama.cpp's."""
    return settings_from_dict(
        {
            "server": {"health_interval_s": 10.0, "refit_interval_s": 0},
            "admission": {"mode": "none"},
            # its requests would count in the engine's prompt-token counters the test compares
            "routing": {"llamacpp_host_cache_probe": False},
            "models": [
                {"name": "vllm-tiny", "pools": ["v"], "model_dir": str(vllm.model_dir)},
                {"name": "llama-tiny", "pools": ["l"]},
            ],
            "pools": [
                {"name": "v", "role": "both", "instances": [{"id": "v0", "url": vllm.url}]},
                {
                    "name": "l",
                    "role": "both",
                    "instances": [{"id": "l0", "url": llama.url, "engine": "llamacpp"}],
                },
            ],
        }
    )


def test_each_model_reaches_only_its_own_engine(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    vllm, llama = engines
    settings = _two_models(vllm, llama)
    v_before = _counter(vllm.url, "vllm:prompt_tokens_total")
    l_before = _counter(llama.url, "llamacpp:prompt_tokens_total") + _counter(
        llama.url, "llamacpp:prompt_tokens_cached_total"
    )
    sent = {"vllm-tiny": 0, "llama-tiny": 0}
    with TestClient(build_app(settings)) as client:
        for k in range(4):
            for model, iid in (("vllm-tiny", "v0"), ("llama-tiny", "l0")):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"hello number {k} " * 20}],
                    "max_tokens": 2,
                }
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvgate-prefill"] == iid
                assert r.json()["model"] == model  # the engine that answered serves this name
                sent[model] += r.json()["usage"]["prompt_tokens"]
        r = client.post("/v1/chat/completions", json={**body, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["vllm-tiny", "llama-tiny"]
    # The engines' own counters saw exactly their model's prompts.
    assert _counter(vllm.url, "vllm:prompt_tokens_total") - v_before == sent["vllm-tiny"]
    l_after = _counter(llama.url, "llamacpp:prompt_tokens_total") + _counter(
        llama.url, "llamacpp:prompt_tokens_cached_total"
    )
    assert l_after - l_before == sent["llama-tiny"]


def test_responses_reach_each_models_engine_whole_and_streamed(
    engines: tuple[EngineProcess, EngineProcess],
) -> None:
    """``/v1/responses`` on both engines behind one gateway: vLLM's and llama.cpp's answers
    relayed, their streams (a ``*.delta`` event per token or more) ended by
    ``response.completed``, and every answer closed in kvgate's books."""
    vllm, llama = engines
    settings = _two_models(vllm, llama)
    app = build_app(settings)
    with TestClient(app) as client:
        for model, iid in (("vllm-tiny", "v0"), ("llama-tiny", "l0")):
            body = {"model": model, "instructions": "Be terse.", "input": "Paris? " * 20}
            r = client.post("/v1/responses", json={**body, "max_output_tokens": 4})
            assert r.status_code == 200 and r.headers["x-kvgate-decode"] == iid, r.text
            assert r.json()["object"] == "response" and r.json()["usage"]["output_tokens"] == 4
            r = client.post("/v1/responses", json={**body, "max_output_tokens": 5, "stream": True})
            assert r.status_code == 200, r.text
            events = [e for e in r.text.split("\n\n") if e.strip()]
            assert events[0].startswith("event: response.created")
            assert events[-1].startswith("event: response.completed")
            assert any(e.startswith("event: response.output_text.delta") for e in events)
        metrics = app.gateway.metrics.render().decode()
        assert 'kvgate_requests_total{outcome="completed"} 4.0' in metrics
        assert len(app.gateway.conductor.requests) == 0
