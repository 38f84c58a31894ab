"""bench.kvgate_epp: `kvgate epp` and a real Envoy as child processes, in front of a stub
engine: a completion through Envoy is placed by the picker (its decision header), the picker's
HTTP side counts it, and both children are gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.kvgate_epp import kvgate_front
from bench.kvgate_serve import free_port, stop_process, wait_healthy
from tests.gateway.epp.envoy_stack import require_envoy


def test_a_request_through_envoy_is_placed_by_the_picker(tmp_path: Path) -> None:
    require_envoy()
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "bench.stub_engine", "--port", str(port)])
    config = tmp_path / "kvgate.toml"
    config.write_text(
        '[admission]\nmode = "none"\n[[pools]]\nname = "w"\nrole = "both"\n'
        f'[[pools.instances]]\nid = "e0"\nurl = "http://127.0.0.1:{port}"\n'
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", engine, 30.0, "stub engine")
        with kvgate_front("epp", config, 0, tmp_path / "e") as (url, admin):
            body = json.dumps({"model": "stub-model", "prompt": "hi " * 50, "max_tokens": 2})
            req = urllib.request.Request(
                url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                placed, answer = resp.headers.get("x-kvgate-prefill"), json.loads(resp.read())
            with urllib.request.urlopen(admin + "/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            children = list((tmp_path / "e").iterdir())
        for gone in (url, admin):  # Envoy and the picker were ended: nothing listens
            with pytest.raises(urllib.error.URLError) as refused:
                urllib.request.urlopen(gone + "/metrics", timeout=5)
            assert isinstance(refused.value.reason, ConnectionRefusedError)
    finally:
        stop_process(engine)
    assert placed == "e0" and answer["choices"]
    assert 'kvgate_requests_total{outcome="completed"} 1.0' in metrics
    assert {p.name for p in children} >= {"envoy.json", "kvgate-epp.log"}
