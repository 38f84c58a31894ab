"""config/examples/envoy-epp.yaml is what gateway/epp/envoy.py generates (the config the
real-Envoy tests run), and Envoy itself accepts it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.gateway.epp.envoy_stack import require_envoy

yaml = pytest.importorskip("yaml")
EXAMPLE = Path(__file__).resolve().parents[3] / "config" / "examples" / "envoy-epp.yaml"


def test_example_matches_the_generated_config() -> None:
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
    from gateway.epp.envoy import envoy_config

    example = yaml.safe_load(EXAMPLE.read_text())
    engines = [("127.0.0.1", p) for p in (8301, 8302, 8303, 8304)]
    generated = envoy_config(listen=("0.0.0.0", 8081), epp=("127.0.0.1", 9002), engines=engines)
    assert example.pop("admin")["address"]["socket_address"]["address"] == "127.0.0.1"
    assert example == generated


@pytest.mark.parametrize("fail_open", [False, True])
def test_envoy_validates_the_configs(fail_open: bool, tmp_path: Path) -> None:
    exe = require_envoy()
    from gateway.epp.envoy import envoy_config

    path = EXAMPLE
    if fail_open:
        cfg = envoy_config(
            listen=("127.0.0.1", 1),
            epp=("127.0.0.1", 2),
            engines=[("127.0.0.1", 3)],
            fail_open=True,
        )
        path = tmp_path / "open.yaml"
        path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [exe, "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "OK" in out.stdout + out.stderr
