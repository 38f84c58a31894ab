"""Mooncake Store sink: mapping, replica policy and failure handling on a fake client, then an
integration test against a real ``mooncake_master``.

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
from collections.abc import Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink
from backends.replication import DryRunSink, Outcome, ReplicationSinkProtocol
from config.settings import ReplicationSettings
from routing.types import ReplicationCommand, ReplicationReason

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


def command(blocks: tuple[int, ...], source: str = "p0", dest: str = "p1") -> ReplicationCommand:
    return ReplicationCommand(
        "rep-1",
        source,
        dest,
        blocks,
        len(blocks) * 16,
        ReplicationReason.PROACTIVE,
        blocks[-1],
        0.0,
    )


# ------------------------------------------------------------------ fake store
class FakeStore:
    """Objects -> segments holding them; copy tasks finish on their second query."""

    def __init__(self, segments: tuple[str, ...] = ("sa", "sb", "sc"), size: int = 4096) -> None:
        self.segments = set(segments)
        self.objects: dict[str, set[str]] = {}
        self.size = size
        self.tasks: dict[int, dict[str, Any]] = {}
        self.creates = 0
        self.fail_next = 0  # tasks to mark FAILED
        self.hang = False  # tasks stay PENDING
        self.delay_s = 0.0  # every call blocks this long (like an RPC)

    def _wait(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)

    def _desc(self, key: str) -> list[Any]:
        bd = SimpleNamespace(size=self.size, transport_endpoint="x", buffer_address=0)
        return [
            SimpleNamespace(
                status=SimpleNamespace(name="COMPLETE"),
                is_memory_replica=lambda: True,
                get_memory_descriptor=lambda bd=bd: SimpleNamespace(buffer_descriptor=bd),
            )
            for _ in self.objects.get(key, ())
        ]

    def get_replica_desc(self, key: str) -> list[Any]:
        self._wait()
        return self._desc(key)

    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]:
        self._wait()
        return {k: self._desc(k) for k in keys if k in self.objects}

    def create_copy_task(self, key: str, targets: list[str]) -> tuple[Any, int]:
        self._wait()
        self.creates += 1
        if any(t not in self.segments for t in targets):
            return (0, 0), -600
        if key not in self.objects:
            return (0, 0), -704
        tid = len(self.tasks) + 1
        failing = self.fail_next > 0
        self.fail_next -= failing
        self.tasks[tid] = {"key": key, "targets": targets, "queries": 0, "fail": failing}
        return (tid, 0), 0

    def query_task(self, task_id: tuple[int, int]) -> tuple[Any, int]:
        self._wait()
        t = self.tasks.get(task_id[0])
        if t is None:
            return None, -1400
        t["queries"] += 1
        status = "PENDING"
        if not self.hang and t["queries"] >= 2:
            status = "FAILED" if t["fail"] else "SUCCESS"
            if status == "SUCCESS":
                self.objects[t["key"]].update(t["targets"])
        return SimpleNamespace(status=SimpleNamespace(name=status), message=status.lower()), 0


def fake_sink(store: FakeStore, **settings: Any) -> MooncakeStoreSink:
    cfg = MooncakeStoreConfig(
        segments={"p0": "sa", "p1": "sb", "p2": "sc"}, poll_interval_s=0.01, retry_backoff_s=0.01
    )
    return MooncakeStoreSink(cfg, ReplicationSettings(**settings), client=store)


# ------------------------------------------------------------------ unit tests
def test_block_keys_and_instance_segments_are_configurable() -> None:
    sink = fake_sink(FakeStore())
    assert sink.key_for(255) == "kvgate/00000000000000ff"
    assert sink.key_for(-1) == "kvgate/ffffffffffffffff"  # signed hashes map to 64-bit keys
    assert sink.keys_for(command((3, 1, 3, 2))) == [sink.key_for(h) for h in (3, 1, 2)]
    assert sink.segment_for("p1") == "sb"
    assert sink.segment_for("p7") == "p7"  # unmapped: segment_template, default the id
    cfg = MooncakeStoreConfig(key_template="m/{hash:x}", segment_template="{instance_id}:17001")
    other = MooncakeStoreSink(cfg, ReplicationSettings(), client=FakeStore())
    assert other.key_for(255) == "m/ff" and other.segment_for("10.0.0.5") == "10.0.0.5:17001"
    with pytest.raises(KeyError):
        MooncakeStoreSink(
            MooncakeStoreConfig(key_template="{block}"), ReplicationSettings(), FakeStore()
        )


def test_replica_count_grows_with_the_access_rate_up_to_max_replicas() -> None:
    sink = fake_sink(FakeStore(), hot_rate_per_s=0.5, max_replicas=4)
    assert [sink.replicas_for(r) for r in (0.0, 0.4, 0.5, 1.0, 1.6, 100.0)] == [1, 1, 2, 3, 4, 4]
    assert fake_sink(FakeStore(), hot_rate_per_s=0.0, max_replicas=3).replicas_for(0.1) == 3


def test_copies_every_block_to_the_destination_segment() -> None:
    store = FakeStore()
    sink = fake_sink(store)
    cmd = command((1, 2, 3))
    for h in cmd.block_hashes:
        store.objects[sink.key_for(h)] = {"sa"}
    res = run(sink.execute(cmd))
    assert res.ok and res.attempts == 1 and res.error is None
    assert res.bytes == 3 * store.size and res.latency_s > 0
    assert all(store.objects[sink.key_for(h)] == {"sa", "sb"} for h in cmd.block_hashes)


def test_copy_to_an_unknown_segment_fails_after_max_retries() -> None:
    store = FakeStore()
    sink = fake_sink(store, max_retries=2)
    cmd = command((1, 2), dest="p9")  # unmapped -> segment "p9", unknown to the store
    for h in cmd.block_hashes:
        store.objects[sink.key_for(h)] = {"sa"}
    res = run(sink.execute(cmd))
    assert res.outcome is Outcome.FAILED and not res.ok and res.executed
    assert res.attempts == 3 and store.creates == 3 * 2
    assert "-600" in (res.error or "") and res.bytes == 0


def test_a_failed_copy_task_is_retried_and_only_for_the_failed_block() -> None:
    store = FakeStore()
    store.fail_next = 1
    sink = fake_sink(store, max_retries=1)
    cmd = command((1, 2))
    for h in cmd.block_hashes:
        store.objects[sink.key_for(h)] = {"sa"}
    res = run(sink.execute(cmd))
    assert res.ok and res.attempts == 2 and store.creates == 3


def test_block_missing_from_the_store_is_not_copied_and_fails() -> None:
    store = FakeStore()
    sink = fake_sink(store, max_retries=0)
    cmd = command((1, 2))
    store.objects[sink.key_for(1)] = {"sa"}
    res = run(sink.execute(cmd))
    assert res.outcome is Outcome.FAILED and "not in store" in (res.error or "")
    assert store.creates == 1 and res.bytes == store.size  # the present block was copied


def test_unconfirmed_copy_times_out() -> None:
    store = FakeStore()
    store.hang = True
    sink = fake_sink(store, timeout_s=0.3)
    cmd = command((1,))
    store.objects[sink.key_for(1)] = {"sa"}
    t0 = time.monotonic()
    res = run(sink.execute(cmd))
    assert res.outcome is Outcome.TIMEOUT and time.monotonic() - t0 < 1.5


def test_blocking_store_calls_do_not_block_the_event_loop() -> None:
    store = FakeStore()
    store.delay_s = 0.1  # every client call blocks its thread like an RPC
    sink = fake_sink(store)
    cmd = command((1, 2))
    for h in cmd.block_hashes:
        store.objects[sink.key_for(h)] = {"sa"}

    async def main() -> tuple[bool, int]:
        ticks = 0
        task = asyncio.create_task(sink.execute(cmd))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.005)
        return (await task).ok, ticks

    ok, ticks = run(main())
    assert ok and ticks > 40  # ~0.4 s of blocking calls; the loop kept turning


def test_ensure_replicas_skips_segments_that_already_hold_the_key() -> None:
    store = FakeStore()
    sink = fake_sink(store)
    store.objects["k"] = {"sa"}
    # Candidates in order: sa (holder: a no-op copy), then sb, sc.
    assert run(sink.ensure_replicas("k", 3)) == 3 and store.objects["k"] == {"sa", "sb", "sc"}
    assert run(sink.ensure_replicas("k", 5)) == 3  # no more candidates
    assert run(sink.replica_count("k")) == 3


def test_dry_run_sink_records_and_executes_nothing() -> None:
    sink = DryRunSink()
    res = run(sink.execute(command((1, 2))))
    assert res.outcome is Outcome.NOT_EXECUTED and not res.ok and not res.executed
    assert res.error == "dry_run" and list(sink.commands) == [command((1, 2))]
    assert isinstance(sink, ReplicationSinkProtocol)
    assert isinstance(fake_sink(FakeStore()), ReplicationSinkProtocol)


def test_without_the_extra_the_sink_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'kvgate\[mooncake\]'"):
        MooncakeStoreSink(MooncakeStoreConfig(), ReplicationSettings())


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
