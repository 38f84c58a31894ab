"""Mooncake Store sink: an integration test against a real ``mooncake_master`` (mapping, replica
policy and failure handling on a fake client: test_mooncake_sink.py).

The integration scenario runs in a subprocess inside a private network namespace (``unshare
--net --map-root-user``) whose only interface is ``lo``. The master binds 127.0.0.1 as told, but
the store client's transfer engine binds its handshake and data listeners to the wildcard address
with no option to change that (mooncake 0.3.13), so the namespace is what keeps them on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink
from config.settings import ReplicationSettings
from routing.types import ReplicationReason

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ integration
def _mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _skip_reason() -> str | None:
    pkg = _mooncake_dir()
    if pkg is None:
        return "mooncake not installed: pip install 'kvgate[mooncake]'"
    if not (pkg / "mooncake_master").is_file():
        return f"the mooncake package ships no mooncake_master for this platform ({pkg})"
    probe = subprocess.run(
        ["unshare", "--net", "--map-root-user", "true"], capture_output=True, text=True, timeout=10
    )
    if probe.returncode != 0:
        why = probe.stderr.strip()
        return f"no private network namespace (unshare --net) to keep mooncake on loopback: {why}"
    return None


def test_hot_prefix_gets_a_second_replica_in_a_real_store(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason is not None:
        warnings.warn(f"mooncake integration test skipped: {reason}", stacklevel=1)
        pytest.skip(reason)
    proc = subprocess.run(
        ["unshare", "--net", "--map-root-user", sys.executable, "-m", __name__, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    log = (tmp_path / "master.log").read_text() if (tmp_path / "master.log").exists() else ""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.stdout}\n{proc.stderr[-4000:]}\n{log[-2000:]}"
    r = json.loads(lines[-1].removeprefix("RESULT "))
    # Loopback only: the namespace has no interface but lo, and the master bound 127.0.0.1.
    assert r["interfaces"] == ["lo"]
    assert ["127.0.0.1", r["master_port"]] in r["listeners"]
    # The planner made the prefix hot on p0 and asked for a copy to another prefill instance.
    assert r["command"]["source"] == "p0" and r["command"]["destination"] in ("p1", "p2")
    assert r["result"]["outcome"] == "ok" and r["result"]["attempts"] == 1
    assert r["result"]["bytes"] == r["blocks"] * r["block_bytes"]
    # Read back with the store's own API: every block now has >= 2 replicas on 2 endpoints.
    assert r["replicas_before"] == [1] * r["blocks"]
    assert all(n >= 2 for n in r["replicas_after"]) and r["endpoints_after"] >= 2
    assert r["data_intact"] and r["index_dest_blocks"] == r["blocks"]
    # An unknown destination segment fails, attempted 1 + max_retries times.
    bad = r["bad"]
    assert bad["outcome"] == "failed" and bad["attempts"] == 3 and "-600" in bad["error"]
    assert bad["creates"] == 3 * r["blocks"]
    assert r["ensure_replicas"] == 2 and r["replicas_for"] == [1, 2, 3]


# ---- the scenario (runs inside the namespace: python -m tests.backends.test_mooncake_store DIR)
def _loopback_up() -> None:
    """A new network namespace starts with lo down; SIOCGIFFLAGS / SIOCSIFFLAGS |= IFF_UP."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        import fcntl

        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))


def _listeners() -> list[list[Any]]:
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            addr, port = local.split(":")
            if len(addr) == 8:
                ip = socket.inet_ntoa(struct.pack("<I", int(addr, 16)))
            else:  # only the v6 wildcard is expected; anything else is shown raw
                ip = "::" if int(addr, 16) == 0 else addr
            out.append([ip, int(port, 16)])
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphaned master


def _wait_port(proc: subprocess.Popen[bytes], port: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.1)
    raise TimeoutError(f"mooncake_master did not listen on 127.0.0.1:{port} in {limit_s}s")


async def _scenario(workdir: Path) -> dict[str, Any]:
    from routing.conductor import Conductor
    from routing.types import BlockStored, Decision
    from tests.routing.fleet import busy, fleet_settings, prompt, request

    _loopback_up()
    interfaces = [
        ln.split(":")[0].strip() for ln in Path("/proc/net/dev").read_text().splitlines()[2:]
    ]
    rpc_port, metrics_port, *seg_ports = _free_ports(5)
    pkg = _mooncake_dir()
    assert pkg is not None
    log = (workdir / "master.log").open("wb")
    master = subprocess.Popen(
        [
            str(pkg / "mooncake_master"),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--enable_http_metadata_server=false",
            "--logtostderr=true",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,  # no threads yet in this process: mooncake not imported
    )
    clients: list[Any] = []
    try:
        _wait_port(master, rpc_port, 30.0)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        def mount(port: int) -> Any:  # one "prefill instance": a client mounting 32 MiB
            c = MooncakeDistributedStore()
            master_addr = f"127.0.0.1:{rpc_port}"
            rc = c.setup(
                f"127.0.0.1:{port}", "P2PHANDSHAKE", 32 << 20, 4 << 20, "tcp", "", master_addr
            )
            assert rc == 0, f"setup -> {rc}"
            clients.append(c)
            return c

        # Three prefill instances: the request lands on one non-holder, the copy on the other.
        stores = {f"p{i}": mount(port) for i, port in enumerate(seg_ports)}
        a = stores["p0"]
        rep = ReplicationSettings(
            hot_rate_per_s=0.05, holder_queue_threshold_s=1.0, cooldown_s=100.0, timeout_s=30.0
        )
        cfg = MooncakeStoreConfig(
            master_addr=f"127.0.0.1:{rpc_port}",
            segments={i: s.get_hostname() for i, s in stores.items()},
            retry_backoff_s=0.05,
        )
        sink = MooncakeStoreSink(cfg, rep)
        await sink.start()

        # The engine on p0 computed the prefix and wrote its blocks to its own segment.
        c = Conductor(fleet_settings(prefill=3, decode=1, policy="cache_aware", replication=rep))
        prefix, block_bytes = prompt(3, 8), 64 << 10
        put_cfg = ReplicateConfig()
        put_cfg.replica_num, put_cfg.preferred_segment = 1, a.get_hostname()
        payload = {h: (h.to_bytes(8, "little") * (block_bytes // 8)) for h in prefix}
        for h in prefix:
            assert a.put(sink.key_for(h), payload[h], put_cfg) == 0
        c.kv_event("p0", BlockStored(prefix), 0.0)

        def replicas(key: str) -> list[Any]:  # the store's own view, through p1's client
            descs = stores["p1"].get_replica_desc(key)
            return [d for d in descs if d.status.name == "COMPLETE"]

        before = [len(replicas(sink.key_for(h))) for h in prefix]
        # Requests sharing the prefix make it hot while its only holder is busy.
        busy(c, "p0", 2.0)
        cmds = []
        for i in range(5):
            d = c.schedule(request(f"r{i}", prefix + prompt(100 + i, 2), now=0.01 * i), 0.01 * i)
            assert isinstance(d, Decision)
            cmds += [x for x in d.replications if x.reason is ReplicationReason.PROACTIVE]
        (cmd,) = cmds
        res = await sink.execute(cmd)
        c.replication_done(cmd.command_id, res.ok, 1.0)
        keys = [sink.key_for(h) for h in prefix]
        after = [replicas(k) for k in keys]
        endpoints = {
            d.get_memory_descriptor().buffer_descriptor.transport_endpoint for d in after[0]
        }
        dest = stores[cmd.destination]
        intact = all(dest.get(sink.key_for(h)) == payload[h] for h in prefix)

        # Failure: destination p9 maps to segment "p9", which no client mounted.
        class Counting:
            creates = 0

            def __getattr__(self, name: str) -> Any:
                return getattr(sink.client, name)

            def create_copy_task(self, key: str, targets: list[str]) -> Any:
                Counting.creates += 1
                return sink.client.create_copy_task(key, targets)

        bad_sink = MooncakeStoreSink(cfg, dataclasses.replace(rep, max_retries=2), Counting())
        bad = await bad_sink.execute(dataclasses.replace(cmd, command_id="bad", destination="p9"))
        await bad_sink.close()

        # Replica policy: a key on p0 only, raised to 2 copies (p0's own copy is a no-op).
        assert a.put("kvgate/policy", b"p" * 4096, put_cfg) == 0
        ensured = await sink.ensure_replicas("kvgate/policy", 2, ["p0", "p1", "p2"])
        await sink.close()
        return {
            "interfaces": interfaces,
            "listeners": _listeners(),
            "master_port": rpc_port,
            "command": {"source": cmd.source, "destination": cmd.destination},
            "result": {
                "outcome": res.outcome.value,
                "attempts": res.attempts,
                "bytes": res.bytes,
                "latency_s": res.latency_s,
                "error": res.error,
            },
            "blocks": len(prefix),
            "block_bytes": block_bytes,
            "replicas_before": before,
            "replicas_after": [len(x) for x in after],
            "endpoints_after": len(endpoints),
            "data_intact": intact,
            "index_dest_blocks": c.index.match(prefix, 1.0).local(cmd.destination),
            "bad": {
                "outcome": bad.outcome.value,
                "attempts": bad.attempts,
                "error": bad.error or "",
                "creates": Counting.creates,
            },
            "ensure_replicas": ensured,
            "replicas_for": [sink.replicas_for(r) for r in (0.01, 0.05, 0.1)],
        }
    finally:
        for client in clients:
            client.close()
        master.terminate()  # by PID: the process this scenario started
        try:
            master.wait(10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait(5)
        log.close()


if __name__ == "__main__":
    out = asyncio.run(asyncio.wait_for(_scenario(Path(sys.argv[1])), timeout=150))
    print("RESULT " + json.dumps(out), flush=True)
