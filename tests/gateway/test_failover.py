"""Kill a decode engine (a real process, SIGKILL) mid-stream under load.

Its clients get a clean SSE error event, other requests are unaffected, the instance is ejected
and re-admitted once it answers again, and the Conductor's books return to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import uvicorn

from config.settings import (
    InstanceSettings,
    PoolSettings,
    PredictorSettings,
    Role,
    RoutingSettings,
    ServerSettings,
    Settings,
)
from gateway.app import build_app
from replay.emulator import EmulatorConfig, start_emulator

ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.25  # 400 tokens x ~7 ms model steps take ~0.7 s of wall time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_decode(port: int) -> subprocess.Popen:
    code = "import sys; from gateway.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "emulate",
            "--role",
            "decode",
            "--protocol",
            "vllm",
            "--port",
            str(port),
            "--time-scale",
            str(SCALE),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _wait_healthy(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise TimeoutError(url)


async def _stream(session: aiohttp.ClientSession, url: str, i: int) -> dict:
    out = {"tokens": 0, "error": False, "decode": None, "status": None}
    async with session.post(
        url + "/v1/completions",
        json={"prompt": f"req {i} " * 40, "max_tokens": 400, "stream": True},
    ) as r:
        out["status"] = r.status
        out["decode"] = r.headers.get("x-kvgate-decode")
        async for line in r.content:
            if line.startswith(b"data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = True
                elif data.get("choices"):
                    out["tokens"] += 1
    return out


def test_killed_decode_is_ejected_and_readmitted() -> None:
    async def run():
        port = _free_port()
        proc = _spawn_decode(port)
        p0 = await start_emulator(EmulatorConfig(role=Role.PREFILL, port=0, time_scale=SCALE))
        d1 = await start_emulator(EmulatorConfig(role=Role.DECODE, port=0, time_scale=SCALE))
        d0_url = f"http://127.0.0.1:{port}"
        await _wait_healthy(d0_url)
        settings = Settings(
            routing=RoutingSettings(policy="round_robin"),
            predictors=PredictorSettings(profile="llama3-8b-h100-tp1"),
            server=ServerSettings(health_interval_s=0.2, refit_interval_s=0),
            pools=(
                PoolSettings("p", Role.PREFILL, (InstanceSettings("p0", p0.url, Role.PREFILL),)),
                PoolSettings(
                    "d",
                    Role.DECODE,
                    (
                        InstanceSettings("d0", d0_url, Role.DECODE),
                        InstanceSettings("d1", d1.url, Role.DECODE),
                    ),
                ),
            ),
        )
        app = build_app(settings)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        conductor = app.gateway.conductor
        try:
            async with aiohttp.ClientSession() as s:
                streams = [asyncio.create_task(_stream(s, url, i)) for i in range(8)]
                # Wait until d0 is decoding, then kill it hard.
                for _ in range(400):
                    await asyncio.sleep(0.01)
                    if conductor.instances["d0"].batch > 0:
                        break
                await asyncio.sleep(0.1)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                results = await asyncio.gather(*streams)
                ejected = False
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if not conductor.instances["d0"].healthy:
                        ejected = True
                        break
                after_kill = [await _stream(s, url, 100 + i) for i in range(4)]
                proc2 = _spawn_decode(port)  # the engine comes back on the same address
                try:
                    readmitted = False
                    for _ in range(300):
                        await asyncio.sleep(0.05)
                        if conductor.instances["d0"].healthy:
                            readmitted = True
                            break
                    books = (
                        len(conductor.requests),
                        sum(
                            i.batch + len(i.incoming) + len(i.prefill_queue)
                            for i in conductor.instances.values()
                        ),
                    )
                finally:
                    proc2.kill()
                    proc2.wait(10)
            return results, ejected, after_kill, readmitted, books
        finally:
            server.should_exit = True
            await task
            await p0.stop()
            await d1.stop()
            if proc.poll() is None:
                proc.kill()

    results, ejected, after_kill, readmitted, books = asyncio.run(run())
    on_d0 = [r for r in results if r["decode"] == "d0"]
    on_d1 = [r for r in results if r["decode"] == "d1"]
    assert on_d0 and on_d1
    assert all(r["error"] and r["tokens"] < 400 for r in on_d0), on_d0
    assert all(not r["error"] and r["tokens"] == 400 for r in on_d1), on_d1
    assert ejected
    assert all(
        r["status"] == 200 and r["tokens"] == 400 and r["decode"] == "d1" for r in after_kill
    ), after_kill
    assert readmitted
    assert books == (0, 0)
