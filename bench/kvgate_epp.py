"""``kvgate epp`` behind a real Envoy, as child processes for benchmarks: the picker on a kvgate
config, Envoy on the config gateway/epp/envoy.py generates for that config's fleet (as
``kvgate envoy-config`` writes it), waited for until a request through Envoy answers; both
ended by PID however the benchmark exits."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.kvgate_serve import KVGATE_MAIN, free_port, kvgate_serve, stop_process, wait_healthy


@contextmanager
def kvgate_epp(config: Path, workdir: Path, timeout_s: float = 60.0) -> Iterator[tuple[str, str]]:
    """Run ``kvgate epp --config config`` and an Envoy in front of its fleet steered by it;
    yields (Envoy's base URL for clients, the picker's HTTP side: /metrics, /admin)."""
    from config.loader import load_settings
    from gateway.epp.envoy import envoy_config, fleet_endpoints, start_envoy

    workdir.mkdir(parents=True, exist_ok=True)
    grpc_port, http_port, listen = free_port(), free_port(), free_port()
    argv = [sys.executable, "-c", KVGATE_MAIN, "epp", "--config", str(config)]
    argv += ["--port", str(grpc_port), "--metrics-port", str(http_port), "--log-level", "warning"]
    with (workdir / "kvgate-epp.log").open("wb") as out:
        picker = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    envoy: subprocess.Popen[bytes] | None = None
    try:
        admin = f"http://127.0.0.1:{http_port}"
        wait_healthy(f"{admin}/metrics", picker, timeout_s, "kvgate epp")
        engines, per_connection = fleet_endpoints(load_settings(config))
        cfg = envoy_config(
            listen=("127.0.0.1", listen),
            epp=("127.0.0.1", grpc_port),
            engines=engines,
            requests_per_connection=per_connection,
        )
        envoy = start_envoy(cfg, workdir)
        url = f"http://127.0.0.1:{listen}"
        wait_healthy(f"{url}/health", envoy, timeout_s, "envoy")  # through the picker
        yield url, admin
    finally:
        if envoy is not None:
            stop_process(envoy)
        stop_process(picker)


@contextmanager
def kvgate_front(kind: str, config: Path, port: int, workdir: Path) -> Iterator[tuple[str, str]]:
    """kvgate in front of the config's engines: ``serve`` (listening on ``port``) or ``epp``
    behind a real Envoy; yields (the clients' base URL, kvgate's /metrics and /admin base URL)."""
    if kind == "epp":
        with kvgate_epp(config, workdir) as urls:
            yield urls
    else:
        with kvgate_serve(config, port, workdir.with_suffix(".log")) as url:
            yield url, url
