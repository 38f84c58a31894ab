"""config/examples/envoy-epp.yaml is what gateway/epp/envoy.py generates (the config the
real-Envoy tests run), and Envoy itself accepts it."""

from __future__ import annotations

import asyncio
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


def test_envoy_drops_an_idle_engine_connection_before_the_engine_does(tmp_path: Path) -> None:
    # uvicorn (vLLM, the pd-sidecar) closes a keep-alive connection after 5 s idle; Envoy's
    # own default keeps it an hour, so a request sent on it just as the engine closes it is
    # reset after it went out, which Envoy does not retry (a P/D test lost its request that
    # way). The engine here answers a connection's first request and drops its second one
    # unanswered, as that race does: Envoy must have dropped the idle connection first.
    exe = require_envoy()
    import aiohttp

    from gateway.epp.envoy import envoy_config, start_envoy
    from gateway.epp.stack import free_port
    from tests.backends.test_http1 import RawServer

    async def run() -> list[int]:
        engine = RawServer()
        engine.drop_second_request = True
        port = await engine.start()
        listen = free_port()
        cfg = envoy_config(
            listen=("127.0.0.1", listen),
            epp=("127.0.0.1", free_port()),  # no picker: fail-open round robin
            engines=[("127.0.0.1", port)],
            fail_open=True,
            upstream_idle_s=0.5,
        )
        proc = start_envoy(cfg, tmp_path, exe)
        statuses = []
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)
            ) as client:
                for attempt in range(200):
                    try:
                        async with client.post(
                            f"http://127.0.0.1:{listen}/v1/completions", json={}
                        ) as r:
                            statuses.append(r.status)
                            break
                    except aiohttp.ClientConnectionError:
                        assert attempt < 199 and proc.poll() is None, "envoy did not listen"
                        await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # the connection idles past upstream_idle_s
                async with client.post(f"http://127.0.0.1:{listen}/v1/completions", json={}) as r:
                    statuses.append(r.status)
        finally:
            proc.terminate()
            proc.wait(10)
            await engine.stop()
        return statuses

    assert asyncio.run(run()) == [200, 200]
