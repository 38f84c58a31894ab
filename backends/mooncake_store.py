"""Replication sink backed by Mooncake Store: a hot prefix gets more replicas in the store.

Mapping (docs/mooncake-store.md):

- one store key per KV block, ``key_template.format(hash=h)`` (default ``kvgate/{hash:016x}``).
  Engines writing to the store (HiCache / LMCache L3) write one object per page keyed by the
  prefix hash up to that page, and kvgate's block hashes are chained the same way, so a block key
  names exactly one reusable piece and a shorter prefix can reuse the keys of a longer one.
- instance id -> segment (the memory a store client mounts; its name is the client's
  ``local_hostname``, e.g. ``10.0.0.5:17001``): ``segments[id]``, else
  ``segment_template.format(instance_id=id)``.

A command copies every block key to the destination's segment with ``create_copy_task(key,
[segment])`` and polls ``query_task`` until each task succeeds or fails; the master picks the
source replica itself, so ``cmd.source`` only matters in that its blocks must be in the store.
The gateway's own client mounts no memory (``global_segment_size=0``) so that no replica is ever
placed on the gateway. The mooncake package is an optional extra, imported only when a sink is
built without an injected client.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from backends.replication import Outcome, ReplicationResult
from config.settings import ReplicationSettings, frozen_mapping
from routing.types import ReplicationCommand

INSTALL_HINT = (
    "the Mooncake Store sink needs the mooncake client: pip install 'kvgate[mooncake]' "
    "(its native library also needs Debian's libibverbs1)"
)
# Codes seen from mooncake-transfer-engine-non-cuda 0.3.13 (Python gets bare ints).
ERROR_NAMES = {
    -600: "INVALID_PARAMS (unknown segment?)",
    -704: "OBJECT_NOT_FOUND",
    -706: "OBJECT_HAS_LEASE",
    -900: "RPC_FAIL",
    -1400: "TASK_NOT_FOUND",
}
_MASK64 = (1 << 64) - 1
T = TypeVar("T")


class StoreClient(Protocol):
    """The slice of ``mooncake.store.MooncakeDistributedStore`` the sink uses."""

    def setup(self, *args: Any) -> int: ...
    def close(self) -> int: ...
    def get_replica_desc(self, key: str) -> list[Any]: ...
    def batch_get_replica_desc(self, keys: list[str]) -> dict[str, list[Any]]: ...
    def create_copy_task(self, key: str, targets: list[str]) -> tuple[Any, int]: ...
    def query_task(self, task_id: Any) -> tuple[Any, int]: ...


@dataclass(frozen=True, slots=True)
class MooncakeStoreConfig:
    master_addr: str = "127.0.0.1:50051"
    # P2P handshake needs no metadata server (nothing more to run or to bind).
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"  # the gateway's own client
    protocol: str = "tcp"
    rdma_devices: str = ""
    global_segment_size: int = 0  # the gateway holds no replicas
    local_buffer_size: int = 1 << 20
    key_template: str = "kvgate/{hash:016x}"
    segment_template: str = "{instance_id}"
    segments: Mapping[str, str] = field(default_factory=frozen_mapping)  # instance id -> segment
    poll_interval_s: float = 0.1
    retry_backoff_s: float = 0.2  # doubles per retry
    threads: int = 4


def error_name(rc: int) -> str:
    return f"{rc} {ERROR_NAMES.get(rc, '')}".strip()


def _new_client() -> StoreClient:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # not installed, or libibverbs.so.1 missing
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return MooncakeDistributedStore()  # type: ignore[no-any-return]


def complete_memory_sizes(descs: Iterable[Any]) -> list[int]:
    """Sizes of the usable in-memory replicas (disk replicas do not relieve a hot spot)."""
    return [
        int(d.get_memory_descriptor().buffer_descriptor.size)
        for d in descs
        if d.is_memory_replica() and getattr(d.status, "name", "") == "COMPLETE"
    ]


class MooncakeStoreSink:
    def __init__(
        self,
        config: MooncakeStoreConfig,
        settings: ReplicationSettings,
        client: StoreClient | None = None,
    ) -> None:
        config.key_template.format(hash=0)  # fail on a bad template now, not per command
        config.segment_template.format(instance_id="x")
        self.config = config
        self.settings = settings
        # An injected client is the caller's: already set up, and closed by the caller.
        self._owns_client = client is None
        self._started = client is not None
        self._closed = False
        self.client: StoreClient = client if client is not None else _new_client()
        # Own threads: slow store RPCs must not starve the loop's default executor (DNS etc.).
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="mooncake-sink")

    # ---- mapping and policy ----
    def key_for(self, block_hash: int) -> str:
        return self.config.key_template.format(hash=block_hash & _MASK64)

    def keys_for(self, cmd: ReplicationCommand) -> list[str]:
        return list(dict.fromkeys(self.key_for(h) for h in cmd.block_hashes))

    def segment_for(self, instance_id: str) -> str:
        seg = self.config.segments.get(instance_id)
        if seg is None:
            seg = self.config.segment_template.format(instance_id=instance_id)
        return seg

    def replicas_for(self, rate_per_s: float) -> int:
        """Target replica count of a key read ``rate_per_s`` times a second: one more per
        ``hot_rate_per_s`` of load, between 1 and ``max_replicas``."""
        s = self.settings
        if rate_per_s <= 0.0:
            return 1
        if s.hot_rate_per_s <= 0.0:
            return max(s.max_replicas, 1)
        return max(1, min(s.max_replicas, 1 + math.floor(rate_per_s / s.hot_rate_per_s)))

    # ---- lifecycle ----
    async def start(self) -> None:
        """Connect the gateway's client to the master (blocks ~4 s when it is down)."""
        if self._started:
            return
        c = self.config
        rc = await self._call(
            self.client.setup,
            c.local_hostname,
            c.metadata_server,
            c.global_segment_size,
            c.local_buffer_size,
            c.protocol,
            c.rdma_devices,
            c.master_addr,
            deadline=time.monotonic() + self.settings.timeout_s,
        )
        if rc != 0:
            raise ConnectionError(f"mooncake setup to {c.master_addr} failed: {error_name(rc)}")
        self._started = True

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # new calls fail from here on
        loop = asyncio.get_running_loop()
        # Let calls already running finish: closing the native client under them crashes.
        await loop.run_in_executor(None, partial(self._pool.shutdown, True, cancel_futures=True))
        if self._owns_client and self._started:
            await loop.run_in_executor(None, self.client.close)

    # ---- commands ----
    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        """Copy the command's blocks to the destination's segment; ok once every copy task
        succeeded. Up to ``max_retries`` retries of the failed keys, all within ``timeout_s``."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.timeout_s
        dest = self.segment_for(cmd.destination)
        pending = self.keys_for(cmd)
        sizes: dict[str, int] = {}
        error: str | None = None
        attempts = 0
        timed_out = False
        while pending and attempts <= self.settings.max_retries:
            if attempts:
                pause = self.config.retry_backoff_s * 2 ** (attempts - 1)
                await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            attempts += 1
            try:
                pending, error = await self._attempt(pending, dest, sizes, deadline)
            except TimeoutError:
                timed_out, error = True, f"not confirmed within {self.settings.timeout_s:g}s"
                break
            except Exception as e:  # a client exception is one failed attempt, not a crash
                error = f"{type(e).__name__}: {e}"
        if pending:
            outcome = Outcome.TIMEOUT if timed_out else Outcome.FAILED
            error = (
                f"{len(pending)} of {len(cmd.block_hashes)} blocks not copied to {dest}: {error}"
            )
        else:
            outcome, error = Outcome.OK, None
        done = sum(v for k, v in sizes.items() if k not in pending)
        return ReplicationResult(
            cmd.command_id, outcome, time.monotonic() - t0, done, error, attempts
        )

    async def _attempt(
        self, keys: list[str], dest: str, sizes: dict[str, int], deadline: float
    ) -> tuple[list[str], str | None]:
        """One pass over ``keys``; returns the keys still not copied and the first error."""
        descs = await self._call(self.client.batch_get_replica_desc, keys, deadline=deadline)
        for k in keys:
            got = complete_memory_sizes(descs.get(k, ()))
            if got:
                sizes[k] = got[0]
        # The engine writes blocks to the store itself; one not there yet may be there later.
        failed = [k for k in keys if k not in sizes]
        errors = [f"source block not in store: {failed[0]}"] if failed else []
        present = [k for k in keys if k in sizes]
        created = await self._call(self._create, present, [dest], deadline=deadline)
        tasks = {}
        for key, (task_id, rc) in created.items():
            if rc == 0:
                tasks[key] = task_id
            else:
                failed.append(key)
                errors.append(f"create_copy_task({key}) -> {error_name(rc)}")
        for key, err in (await self._poll(tasks, deadline)).items():
            if err is not None:
                failed.append(key)
                errors.append(err)
        return failed, (errors[0] if errors else None)

    async def ensure_replicas(
        self, key: str, n: int, instances: Sequence[str] | None = None
    ) -> int:
        """Copy ``key`` to candidate segments until it has ``n`` in-memory replicas or the
        candidates (``instances``' segments, default every mapped one) run out. Returns the
        final count. A copy to a segment that already holds the key is a no-op success, so the
        count is re-read after each round."""
        deadline = time.monotonic() + self.settings.timeout_s
        ids = instances if instances is not None else list(self.config.segments)
        candidates = list(dict.fromkeys(self.segment_for(i) for i in ids))
        have = await self._count(key, deadline)
        while have < n and candidates:
            batch, candidates = candidates[: n - have], candidates[n - have :]
            create = self.client.create_copy_task
            task_id, rc = await self._call(create, key, batch, deadline=deadline)
            if rc == 0:
                await self._poll({key: task_id}, deadline)
            have = await self._count(key, deadline)
        return have

    async def replica_count(self, key: str) -> int:
        return await self._count(key, time.monotonic() + self.settings.timeout_s)

    # ---- helpers ----
    async def _count(self, key: str, deadline: float) -> int:
        descs = await self._call(self.client.get_replica_desc, key, deadline=deadline)
        return len(complete_memory_sizes(descs))

    async def _poll(self, tasks: dict[str, Any], deadline: float) -> dict[str, str | None]:
        """Wait for copy tasks; key -> None on success, else the error. Raises TimeoutError
        at the deadline (the store may still finish those copies later)."""
        out: dict[str, str | None] = {}
        while tasks:
            await asyncio.sleep(self.config.poll_interval_s)
            states = await self._call(self._query, dict(tasks), deadline=deadline)
            for key, (status, message, rc) in states.items():
                if rc != 0:
                    out[key] = f"query_task({key}) -> {error_name(rc)}"
                elif status == "SUCCESS":
                    out[key] = None
                elif status == "FAILED":
                    out[key] = f"copy of {key} failed: {message}"
                else:  # PENDING / PROCESSING
                    continue
                del tasks[key]
        return out

    def _create(self, keys: list[str], targets: list[str]) -> dict[str, tuple[Any, int]]:
        # One thread hop for the whole batch rather than one per key.
        return {k: self.client.create_copy_task(k, targets) for k in keys}

    def _query(self, tasks: dict[str, Any]) -> dict[str, tuple[str, str, int]]:
        out = {}
        for key, task_id in tasks.items():
            resp, rc = self.client.query_task(task_id)
            status = getattr(getattr(resp, "status", None), "name", "") if resp else ""
            out[key] = (status, str(getattr(resp, "message", "")), rc)
        return out

    async def _call(self, fn: Callable[..., T], *args: Any, deadline: float) -> T:
        if self._closed:
            raise RuntimeError("MooncakeStoreSink is closed")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(
            loop.run_in_executor(self._pool, partial(fn, *args)), remaining
        )
