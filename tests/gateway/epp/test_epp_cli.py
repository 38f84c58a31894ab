"""`kvgate epp` as a process: it starts, serves gRPC health for Envoy and Kubernetes, drains
on SIGTERM and exits 0; it refuses configs it cannot serve; `kvgate --help` stays light."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COLOCATED = ROOT / "config" / "examples" / "colocated.toml"
PD = ROOT / "config" / "examples" / "pd-vllm.toml"


def _kvgate(*args: str) -> list[str]:
    return [
        sys.executable,
        "-c",
        "import sys; from gateway.cli import main; sys.exit(main())",
        *args,
    ]


def test_help_imports_no_grpc() -> None:
    code = (
        "import sys; from gateway.cli import main\n"
        "try:\n    main(['epp', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('grpc', 'numpy', 'lightgbm', 'envoy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert "--fallbacks" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_pd_config_without_sidecars_is_refused_with_a_clear_error() -> None:
    out = subprocess.run(
        _kvgate("epp", "--config", str(PD), "--port", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "has no sidecar_url" in out.stderr and "kvgate pd-sidecar" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_bad_message_timeout_is_refused_with_a_clear_error() -> None:
    out = subprocess.run(
        _kvgate("epp", "--config", str(COLOCATED), "--port", "0", "--message-timeout-s", "0"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "--message-timeout-s / --max-message-timeout-s: message timeout must be > 0" in (
        out.stderr
    )
    assert "Traceback" not in out.stderr


def test_epp_process_serves_health_and_drains_on_sigterm(tmp_path: Path) -> None:
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    log = (tmp_path / "epp.log").open("w+")
    proc = subprocess.Popen(
        _kvgate("epp", "--config", str(COLOCATED), "--port", "0", "--log-level", "warning"),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            log.seek(0)
            m = re.search(r"grpc://127\.0\.0\.1:(\d+)", log.read())
            port = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert port, f"no start line: {log.seek(0) or log.read()}"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in (
                "",
                "liveness",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
            ):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, service
            with pytest.raises(grpc.RpcError) as err:
                stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
