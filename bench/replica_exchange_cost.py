"""CPU cost of the replica exchange: one replica's snapshot (+ msgpack) and one peer's
decode + merge into the books, for a given amount of work in flight (docs/replicas.md); and
what publishing on dispatch adds: the gap between two such snapshots (GAP_COST_FACTOR times a
snapshot's cost, at least MIN_DISPATCH_GAP_S), so the most snapshots per second a burst of
dispatches can cause and the CPU they take to publish and, per peer, to merge.

    python -m bench.replica_exchange_cost --in-flight 100 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from config.replica_settings import ReplicasSettings
from config.settings import InstanceSettings, PoolSettings, Role, Settings
from gateway.replica_exchange import (
    DISPATCH_BURST,
    GAP_COST_FACTOR,
    MIN_DISPATCH_GAP_S,
    ReplicaExchange,
)
from gateway.replica_snapshot import Snapshot, decode, encode
from routing.conductor import Conductor
from routing.replica_load import ReplicaLoad, own_work
from routing.types import Decision, RequestInfo


def _fleet(n: int) -> Settings:
    pools = tuple(
        PoolSettings(
            role.value,
            role,
            tuple(
                InstanceSettings(f"{role.value[0]}{i}", f"http://127.0.0.1:{1 + i}", role)
                for i in range(n)
            ),
        )
        for role in (Role.PREFILL, Role.DECODE)
    )
    return Settings(pools=pools)


def measure(in_flight: int, instances: int = 8, seconds: float = 1.0) -> dict:
    a, b = Conductor(_fleet(instances)), Conductor(_fleet(instances))
    for k in range(in_flight):  # 64-block prompts, each its own; every other one decoding
        blocks = tuple(k * 1000 + i for i in range(64))
        req = RequestInfo(f"r{k}", 64 * 16, blocks, max_tokens=128, arrival_s=0.0)
        d = a.schedule(req, 0.0)
        assert isinstance(d, Decision)
        a.dispatched(d, req, 0.0)
        if k % 2:
            a.prefill_done(req.request_id, 0.01)
    peers = ReplicaLoad(b.instances)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        payload = encode(Snapshot("A", 1, n + 1, own_work(a.requests, a.instances, 0.02)))
        n += 1
    publish = (time.perf_counter() - t0) / n
    m, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        snap = decode(payload)
        peers.set_peer_load("A", snap.work, 0.02 + m * 1e-6, ttl_s=1.0, seq=m + 1)
        m += 1
    merge = (time.perf_counter() - t0) / m
    gap = max(MIN_DISPATCH_GAP_S, GAP_COST_FACTOR * publish)
    return {
        "in_flight": in_flight,
        "snapshot_encode_ms": round(publish * 1e3, 3),
        "payload_bytes": len(payload),
        "decode_merge_ms": round(merge * 1e3, 3),
        # Publishing on dispatch, at its worst (a dispatch in every gap; a burst of
        # DISPATCH_BURST dispatches goes out at once, then one snapshot per gap):
        "dispatch_gap_ms": round(gap * 1e3, 3),
        "max_dispatch_snapshots_per_s": round(1 / gap),
        "max_dispatch_publish_cpu": round(publish / gap, 4),  # share of a core
        "max_dispatch_merge_cpu_per_peer": round(merge / gap, 4),
    }


def catch_up_cost(seconds: float = 0.5) -> float:
    """Microseconds the hook adds to a decision when no snapshot is waiting (the usual case:
    one NOBLOCK receive that finds nothing)."""

    async def run() -> float:
        cfg = ReplicasSettings(enabled=True, bind="tcp://127.0.0.1:*", replica_id="A")
        ex = ReplicaExchange(cfg, Conductor(_fleet(2)), time.monotonic)
        ex.start()
        try:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                ex.catch_up()
                n += 1
            return (time.perf_counter() - t0) / n * 1e6
        finally:
            ex.close()

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_exchange_cost", description=__doc__)
    p.add_argument("--in-flight", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--seconds", type=float, default=1.0, help="per measurement (bounded)")
    args = p.parse_args(argv)
    for n in args.in_flight:
        print(json.dumps(measure(n, seconds=min(args.seconds, 10.0))))
    print(
        json.dumps(
            {
                "catch_up_empty_us": round(catch_up_cost(min(args.seconds, 10.0)), 2),
                "dispatch_burst": DISPATCH_BURST,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
