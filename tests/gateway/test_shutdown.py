"""Graceful restarts (issue 12 item 5): SIGTERM to a real ``kvgate serve`` child process during
streaming answers, SIGHUP reloads, and the drain's own state machine.

The child serves one emulated engine that runs in this test's event loop. After SIGTERM: a
short stream completes, a long one ends at the drain deadline with a clean SSE error event and
``[DONE]``, new requests get 503 + Retry-After in OpenAI's shape, and the process exits 0.
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

from config.settings import Role
from gateway.drain import Drain
from replay.emulator import EmulatorConfig, start_emulator

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t0ken"


def _port() -> int:
    """A free loopback port, from 18200-18299 where one is free (keeps sessions apart)."""
    for port in range(18200, 18300):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(engine_url: str, ttft_s: float = 5.0) -> str:
    return f"""
[server]
admin_token = "{TOKEN}"
refit_interval_s = 0
drain_timeout_s = 1.5

[slo]
ttft_s = {ttft_s}

[admission]
mode = "none"

[[pools]]
name = "w"
role = "both"

[[pools.instances]]
id = "w0"
url = "{engine_url}"
"""


async def _until_up(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "kvgate serve exited during start-up"
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


async def _stream(s: aiohttp.ClientSession, url: str, max_tokens: int, started: asyncio.Event):
    out: dict = {"status": None, "tokens": 0, "errors": [], "done": False}
    body = {"prompt": "drain me " * 30, "max_tokens": max_tokens, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        out["status"] = r.status
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                out["done"] = True
            elif line.startswith(b"data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    out["errors"].append(data["error"])
                elif data.get("choices"):
                    out["tokens"] += 1
                    started.set()
    return out


async def _slo(s: aiohttp.ClientSession, url: str) -> float:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with s.get(url + "/admin/slo", headers=headers) as r:
        return (await r.json())["ttft_s"]


def test_sigterm_drains_streams_and_exits_0_and_sighup_reloads(tmp_path: Path) -> None:
    async def run() -> dict:
        engine = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=1.0))
        cfg = tmp_path / "kvgate.toml"
        cfg.write_text(_config(engine.url))
        port = _port()
        url = f"http://127.0.0.1:{port}"
        log = (tmp_path / "serve.log").open("w")
        code = "import sys; from gateway.cli import main; sys.exit(main())"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(cfg), "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        out: dict = {}
        try:
            await _until_up(url, proc)
            async with aiohttp.ClientSession() as s:
                # SIGHUP: a valid file is applied, a bad one changes nothing.
                cfg.write_text(_config(engine.url, ttft_s=7.0))
                os.kill(proc.pid, signal.SIGHUP)
                for _ in range(100):
                    if await _slo(s, url) == 7.0:
                        break
                    await asyncio.sleep(0.05)
                out["reloaded"] = await _slo(s, url)
                cfg.write_text(_config(engine.url, ttft_s=9.0) + "\n[slo\n")
                os.kill(proc.pid, signal.SIGHUP)
                headers = {"Authorization": f"Bearer {TOKEN}"}
                async with s.post(url + "/admin/reload", headers=headers) as r:
                    out["bad_reload"] = (r.status, (await r.json())["error"]["message"])
                out["after_bad"] = await _slo(s, url)

                # SIGTERM while two answers stream: a short one and one that outlasts the
                # drain deadline.
                short_on, long_on = asyncio.Event(), asyncio.Event()
                short = asyncio.create_task(_stream(s, url, 60, short_on))
                long = asyncio.create_task(_stream(s, url, 4000, long_on))
                await asyncio.wait_for(asyncio.gather(short_on.wait(), long_on.wait()), 20)
                t0 = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with aiohttp.ClientSession() as fresh:  # a new connection, as a new client
                    body = {"prompt": "late", "max_tokens": 2}
                    async with fresh.post(url + "/v1/completions", json=body) as r:
                        out["late"] = (r.status, r.headers.get("retry-after"), await r.json())
                    async with fresh.get(url + "/health") as r:
                        out["health"] = r.status
                out["short"], out["long"] = await asyncio.wait_for(asyncio.gather(short, long), 20)
                out["long_ended_after_s"] = time.monotonic() - t0
            out["exit"] = await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
            out["exited_after_s"] = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
            await engine.stop()
        out["log"] = (tmp_path / "serve.log").read_text()
        return out

    out = asyncio.run(asyncio.wait_for(run(), 60))
    log = out["log"]
    assert out["reloaded"] == 7.0
    status, message = out["bad_reload"]
    assert status == 400 and "invalid TOML" in message and "line" in message
    assert out["after_bad"] == 7.0  # the bad file kept the running config
    assert "config reload from" in log and "keeping the running config" in log
    status, retry_after, body = out["late"]
    assert status == 503 and retry_after is not None and int(retry_after) >= 1
    assert body["error"]["code"] == "shutting_down" and body["error"]["type"]
    assert out["health"] == 503
    short, long = out["short"], out["long"]
    assert short["status"] == 200 and short["done"] and not short["errors"]
    assert short["tokens"] == 60
    assert long["status"] == 200 and long["done"] and 0 < long["tokens"] < 4000
    assert [e["code"] for e in long["errors"]] == ["shutting_down"]
    assert 1.0 < out["long_ended_after_s"] < 6.0  # the 1.5 s deadline, not the whole answer
    assert out["exit"] == 0 and out["exited_after_s"] < 10.0
    assert "Traceback" not in log


# --- the drain's own books ------------------------------------------------------------------


class _Answer:
    """Stands in for an open UpstreamResponse: the drain only closes it."""

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_drain_waits_for_requests_then_aborts_the_rest() -> None:
    async def run() -> None:
        now = [100.0]
        drain = Drain(clock=lambda: now[0])
        assert not drain.draining and drain.retry_after_s() == 1
        quick, slow = _Answer(), _Answer()
        drain.enter()
        drain.streaming("quick", quick)  # type: ignore[arg-type]
        drain.enter()
        drain.streaming("slow", slow)  # type: ignore[arg-type]

        async def quick_finishes() -> None:
            await asyncio.sleep(0.05)
            drain.leave("quick")

        async def slow_leaves_when_cut() -> None:
            while not slow.closed:
                await asyncio.sleep(0.01)
            drain.leave("slow")  # the relay saw its answer closed and ended it

        tasks = [asyncio.create_task(quick_finishes()), asyncio.create_task(slow_leaves_when_cut())]
        report = await drain.run(timeout_s=0.3, settle_s=1.0)
        await asyncio.gather(*tasks)
        assert drain.draining and drain.aborting
        assert (report.finished, report.aborted) == (1, 1)
        assert quick.closed == 0 and slow.closed == 1 and drain.active == 0
        late = _Answer()  # an answer that opens after the deadline is cut at once
        drain.enter()
        drain.streaming("late", late)  # type: ignore[arg-type]
        assert late.closed == 1 and "late" in drain.aborted
        drain.leave("late")
        assert "late" not in drain.aborted and drain.active == 0
        assert drain.begin(5.0) is False  # already draining

    asyncio.run(asyncio.wait_for(run(), 5))


def test_an_idle_drain_ends_at_once_and_retry_after_follows_the_deadline() -> None:
    async def run() -> None:
        now = [0.0]
        drain = Drain(clock=lambda: now[0])
        assert drain.begin(30.0)
        now[0] = 10.2
        assert drain.retry_after_s() == 20  # ceil(19.8)
        now[0] = 40.0
        assert drain.retry_after_s() == 1
        report = await Drain().run(timeout_s=5.0)
        assert (report.finished, report.aborted) == (0, 0) and report.waited_s < 0.5

    asyncio.run(asyncio.wait_for(run(), 5))
