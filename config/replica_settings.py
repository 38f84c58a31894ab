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
    # Publish right after each dispatch too (token-bucketed) and apply waiting peer snapshots
    # before each decision: a burst's requests see each other across replicas. False: only
    # every publish_interval_s (the exchange before 2026-11-27; kept for comparison).
    publish_on_dispatch: bool = True
    # Break placement ties (equal predicted TTFT, e.g. an idle fleet) in an order rotated by
    # this replica's rank among ``bind`` + ``peers``: replicas deciding at the same instant,
    # before either's dispatch reached the other, start on different instances.
    rotate_ties: bool = True
