"""The replica exchange (gateway/replica_exchange.py): wire format, merge, and two replicas in
front of one emulated engine, one a real ``kvgate serve`` child that is killed mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from config.loader import settings_from_dict
from config.replica_settings import ReplicasSettings
from config.settings import Role
from gateway.replica_exchange import ReplicaExchange
from gateway.replica_snapshot import Snapshot, encode
from gateway.runtime import Gateway
from replay.emulator import EmulatorConfig, start_emulator
from routing.replica_load import PEER_PREFIX, InstanceWork, PrefillItem
from tests.routing.fleet import make_conductor

ROOT = Path(__file__).resolve().parents[2]


_GIVEN: set[int] = set()


def _port() -> int:
    """A free loopback port in 20900-20999 (this feature's range), never the same one twice."""
    for port in range(20900, 21000):
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free port in 20900-20999")


def test_receive_keeps_the_newest_snapshot_and_a_goodbye_drops_the_share() -> None:
    conductor = make_conductor(prefill=1, decode=1)
    t = [0.0]
    ex = ReplicaExchange(ReplicasSettings(enabled=True), conductor, lambda: t[0])
    p0 = conductor.instances["p0"]
    older = encode(Snapshot("A", 1, 1, {"p0": InstanceWork((PrefillItem(100, 5.0),))}))
    newer = encode(Snapshot("A", 1, 2, {"p0": InstanceWork((PrefillItem(200, 1.0),))}))
    ex.receive([older, newer, b"junk"])
    assert (p0.queued_tokens, ex.stats.received, ex.stats.invalid) == (200, 1, 1)
    ex.receive([older])
    assert (p0.queued_tokens, ex.stats.stale) == (200, 1)
    ex.receive([encode(Snapshot(ex.replica_id, 1, 9, {"p0": InstanceWork((PrefillItem(1, 1),))}))])
    assert p0.queued_tokens == 200  # its own echo is not peer load
    ex.receive([encode(Snapshot("A", 1, 3, bye=True))])
    assert p0.queued_tokens == 0 and p0.queue_time(0.0) == 0.0 and not ex.peers


def _config(engine_url: str, bind: str, peer: str, replica: str) -> str:
    return f"""
[server]
refit_interval_s = 0
[admission]
mode = "none"
[replicas]
enabled = true
replica_id = "{replica}"
bind = "{bind}"
peers = ["{peer}"]
publish_interval_s = 0.05
[[pools]]
name = "w"
role = "both"
[[pools.instances]]
id = "w0"
url = "{engine_url}"
"""


def _peer_entries(gw: Gateway) -> int:
    inst = gw.conductor.instances["w0"]
    return sum(
        rid.startswith(PEER_PREFIX) for rid in (*inst.prefill_queue, *inst.incoming, *inst.running)
    )


async def _until(cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def _complete(s: aiohttp.ClientSession, url: str, max_tokens: int) -> int:
    body = {"prompt": "replicas " * 200, "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True  # tokens reach the books as they stream: the decode is seen running
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


def test_two_replicas_see_each_others_work_and_a_killed_ones_expires(tmp_path: Path) -> None:
    async def run() -> dict:
        engine = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=1.0))
        a_bind, b_bind = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
        # Replica B: in this process, so its books can be read directly.
        b_settings = settings_from_dict(_toml(_config(engine.url, b_bind, a_bind, "B")))
        gw_b = Gateway(b_settings)
        await gw_b.startup()
        port = _port()
        url = f"http://127.0.0.1:{port}"
        cfg = tmp_path / "a.toml"
        cfg.write_text(_config(engine.url, a_bind, b_bind, "A"))
        log = (tmp_path / "a.log").open("w")
        code = "import sys; from gateway.cli import main; sys.exit(main())"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(cfg), "--port", str(port)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        out: dict = {}
        try:
            async with aiohttp.ClientSession() as s:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    assert proc.poll() is None, "replica A exited during start-up"
                    with contextlib.suppress(aiohttp.ClientError):
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    await asyncio.sleep(0.1)
                await _until(lambda: "A" in gw_b.replicas.peers, 10)
                # A short request through A: B sees it while it runs, then sees it end.
                short = asyncio.create_task(_complete(s, url, 300))
                await _until(lambda: _peer_entries(gw_b) > 0, 10)  # in prefill, then decoding
                await _until(lambda: gw_b.conductor.instances["w0"].batch > 0, 10)
                out["seen_batch"] = gw_b.conductor.instances["w0"].batch
                out["short"] = await short
                out["cleared_after_s"] = await _until(lambda: _peer_entries(gw_b) == 0, 2)
                # A long one, then A is killed (no goodbye): B's share of it expires.
                long = asyncio.create_task(_complete(s, url, 3000))
                await _until(lambda: gw_b.conductor.instances["w0"].batch > 0, 10)
                proc.kill()
                t0 = time.monotonic()
                await _until(lambda: _peer_entries(gw_b) == 0, 5)
                out["expired_after_s"] = time.monotonic() - t0
                out["expired"] = gw_b.replicas.stats.expired
                out["books"] = gw_b.conductor.instances["w0"].reserved_tokens
                long.cancel()
                with contextlib.suppress(BaseException):
                    await long
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            log.close()
            await gw_b.shutdown()
            await engine.stop()
        return out

    out = asyncio.run(asyncio.wait_for(run(), 90))
    assert out["seen_batch"] >= 1
    assert out["short"] == 200
    assert out["cleared_after_s"] < 0.5  # the next snapshot, 50 ms later
    # TTL 0.15 s (3 x 50 ms) after the last snapshot; scheduling slack on a busy box.
    assert 0.05 <= out["expired_after_s"] < 1.0
    assert out["expired"] == 1
    assert out["books"] == 0


def _toml(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


def test_a_taken_bind_port_fails_start_up_with_the_endpoint_named() -> None:
    conductor = make_conductor(prefill=1, decode=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cfg = replace(ReplicasSettings(enabled=True), bind=f"tcp://127.0.0.1:{taken}")
        ex = ReplicaExchange(cfg, conductor, time.monotonic)
        with pytest.raises(RuntimeError, match=f"replicas.bind tcp://127.0.0.1:{taken}"):
            ex.start()
        ex.close()
