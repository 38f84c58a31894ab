"""Mooncake Store sink on a fake store client: block keys and segments, the replica policy,
retries and timeouts, and a dry run. The real mooncake_master: test_mooncake_store.py."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any, TypeVar

import pytest

from backends.mooncake_store import MooncakeStoreConfig, MooncakeStoreSink
from backends.replication import DryRunSink, Outcome, ReplicationSinkProtocol
from config.settings import ReplicationSettings
from routing.types import ReplicationCommand, ReplicationReason

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
