"""config/examples/envoy-epp.yaml is what gateway/epp/envoy.py generates (the config the
real-Envoy tests run), and Envoy itself accepts it."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

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


async def _through_envoy(engine, tmp_path: Path, pauses_s: list[float], **config: Any) -> list[int]:
    """One request to a fail-open Envoy (no picker: round robin) in front of ``engine`` (a
    RawServer), then one more after each pause; every answer's status."""
    import aiohttp

    from gateway.epp.envoy import envoy_config, start_envoy
    from gateway.epp.stack import free_port

    port = await engine.start()
    listen = free_port()
    cfg = envoy_config(
        listen=("127.0.0.1", listen),
        epp=("127.0.0.1", free_port()),
        engines=[("127.0.0.1", port)],
        fail_open=True,
        **config,
    )
    proc = start_envoy(cfg, tmp_path, require_envoy())
    url = f"http://127.0.0.1:{listen}/v1/completions"
    statuses = []
    try:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as client:
            for attempt in range(200):  # the first: once Envoy listens
                try:
                    async with client.post(url, json={}) as r:
                        statuses.append(r.status)
                        break
                except aiohttp.ClientConnectionError:
                    assert attempt < 199 and proc.poll() is None, "envoy did not listen"
                    await asyncio.sleep(0.05)
            for pause in pauses_s:
                await asyncio.sleep(pause)
                async with client.post(url, json={}) as r:
                    statuses.append(r.status)
    finally:
        proc.terminate()
        proc.wait(10)
        await engine.stop()
    return statuses


def test_envoy_drops_an_idle_engine_connection_before_the_engine_does(tmp_path: Path) -> None:
    # uvicorn (vLLM, the pd-sidecar) closes a keep-alive connection after 5 s idle; Envoy's
    # own default keeps it an hour, so a request sent on it just as the engine closes it is
    # reset after it went out, which Envoy does not retry (a P/D test lost its request that
    # way). The engine here answers a connection's first request and drops its second one
    # unanswered, as that race does: Envoy must have dropped the idle connection first.
    from tests.backends.test_http1 import RawServer

    engine = RawServer()
    engine.drop_second_request = True
    statuses = asyncio.run(_through_envoy(engine, tmp_path, [1.0], upstream_idle_s=0.5))
    assert statuses == [200, 200]  # the connection idled past upstream_idle_s: a new one


def test_one_request_per_engine_connection_for_engines_that_close_after_each(
    tmp_path: Path,
) -> None:
    # llama-server closes its connection after each streamed answer without saying so
    # (gateway/epp/envoy.py): with requests_per_connection=1 Envoy never reuses one. The
    # engine here drops a connection's second request unanswered; requests back to back.
    from tests.backends.test_http1 import RawServer

    engine = RawServer()
    engine.drop_second_request = True
    statuses = asyncio.run(_through_envoy(engine, tmp_path, [0.0] * 9, requests_per_connection=1))
    assert statuses == [200] * 10 and engine.connections == 10
