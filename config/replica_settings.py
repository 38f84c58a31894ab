"""The typed ``[replicas]`` section: several kvgate replicas in front of one fleet (checked in
config/replica_checks.py, run by gateway/replica_exchange.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReplicasSettings:
    """Several kvgate replicas in front of one fleet (off by default; docs/replicas.md): each
    publishes its dispatched-but-unfinished work over ZMQ PUB and counts the peers' as load."""

    enabled: bool = False
    replica_id: str | None = None  # None = "<hostname>:<pid>"
    bind: str = "tcp://127.0.0.1:5600"  # this replica's PUB endpoint
    peers: tuple[str, ...] = ()  # the other replicas' ``bind`` endpoints (SUB connects)
    publish_interval_s: float = 0.05
    ttl_s: float | None = None  # a silent peer's share expires after this; None = 3 intervals
