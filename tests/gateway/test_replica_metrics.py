"""The replica exchange's counters on /metrics (gateway/replica_metrics.py): what a replica
published (by trigger) and what its peer received, read at scrape time from the real
exchanges on loopback, and a gateway with replicas on exports them."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from config.loader import settings_from_dict
from gateway.replica_metrics import ReplicaExchangeCollector
from gateway.runtime import Gateway
from tests.gateway.test_replica_dispatch_publish import _close, _dispatch, _pair, _seen_within


def _samples(collector: ReplicaExchangeCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_published_and_received_snapshots_are_counted() -> None:
    async def run() -> tuple[dict, dict]:
        a, b, task = await _pair(on_dispatch=True)
        try:
            _dispatch(a.conductor, "r1", 1, 0.0)
            assert await _seen_within(b, 1, 5.0) is not None
            return _samples(ReplicaExchangeCollector(a)), _samples(ReplicaExchangeCollector(b))
        finally:
            await _close(a, b, task)

    a, b = asyncio.run(asyncio.wait_for(run(), 30))
    assert a[("kvgate_replica_snapshots_published_total", (("trigger", "dispatch"),))] == 1
    assert a[("kvgate_replica_snapshots_published_total", (("trigger", "interval"),))] >= 1
    assert b[("kvgate_replica_snapshots_received_total", (("result", "applied"),))] >= 2
    assert b[("kvgate_replica_snapshots_received_total", (("result", "invalid"),))] == 0
    assert b[("kvgate_replica_peers", ())] == 1 and a[("kvgate_replica_peers", ())] == 0


def test_a_gateway_with_replicas_exports_them_and_one_without_does_not() -> None:
    pools = [
        {"name": "w", "role": "both", "instances": [{"id": "e0", "url": "http://127.0.0.1:9"}]}
    ]
    on = Gateway(
        settings_from_dict(
            {"replicas": {"enabled": True, "bind": "tcp://127.0.0.1:23990"}, "pools": pools}
        )
    )
    off = Gateway(settings_from_dict({"pools": pools}))
    assert b"kvgate_replica_snapshots_published_total" in on.metrics.render()
    assert b"kvgate_replica_" not in off.metrics.render()
