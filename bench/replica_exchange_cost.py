"""CPU cost of the replica exchange: one replica's snapshot (+ msgpack) and one peer's
decode + merge into the books, for a given amount of work in flight (docs/replicas.md).

    python -m bench.replica_exchange_cost --in-flight 100 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from config.settings import InstanceSettings, PoolSettings, Role, Settings
from gateway.replica_exchange import Snapshot, decode, encode
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
    return {
        "in_flight": in_flight,
        "snapshot_encode_ms": round(publish * 1e3, 3),
        "payload_bytes": len(payload),
        "decode_merge_ms": round(merge * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replica_exchange_cost", description=__doc__)
    p.add_argument("--in-flight", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--seconds", type=float, default=1.0, help="per measurement (bounded)")
    args = p.parse_args(argv)
    for n in args.in_flight:
        print(json.dumps(measure(n, seconds=min(args.seconds, 10.0))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
