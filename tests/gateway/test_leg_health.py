"""Leg outcomes -> instance health (gateway/leg_health.py): a refused connection ejects at
once, other failures count toward the breaker, a verdict of healthy brings it back. Real
Conductor, real metrics registry, a hand-driven clock."""

from __future__ import annotations

from backends.legs import Failure
from gateway.leg_health import LegHealth
from gateway.metrics import GatewayMetrics
from tests.routing.fleet import make_conductor


def _legs() -> tuple[LegHealth, GatewayMetrics]:
    conductor = make_conductor(prefill=2, decode=1)
    metrics = GatewayMetrics()
    legs = LegHealth(conductor, metrics, clock=lambda: 100.0)
    for iid in conductor.instances:
        legs.add(iid)
    return legs, metrics


def _healthy(metrics: GatewayMetrics, iid: str) -> float | None:
    return metrics.registry.get_sample_value("kvgate_instance_healthy", {"instance": iid})


def test_a_refused_connection_ejects_the_instance_at_once() -> None:
    legs, metrics = _legs()
    legs.failed("p0", Failure.REFUSED)
    assert not legs.conductor.instances["p0"].healthy
    assert legs.conductor.instances["p1"].healthy
    assert _healthy(metrics, "p0") == 0


def test_other_failures_count_until_the_breaker_opens() -> None:
    legs, _ = _legs()
    threshold = legs.breakers["p0"].config.failure_threshold
    for _ in range(threshold - 1):
        legs.failed("p0", Failure.CONNECT)
    assert legs.conductor.instances["p0"].healthy
    legs.failed("p0", Failure.CONNECT)
    assert not legs.conductor.instances["p0"].healthy


def test_healthy_again_resets_the_breaker_and_removal_forgets_it() -> None:
    legs, metrics = _legs()
    legs.failed("p0", Failure.REFUSED)
    legs.changed("p0", True)
    assert legs.conductor.instances["p0"].healthy
    assert legs.breakers["p0"].allow(100.0)
    assert _healthy(metrics, "p0") == 1
    legs.remove("p0")
    assert "p0" not in legs.breakers
    legs.failed("p0", Failure.REFUSED)  # a late leg of a removed instance: counted, no crash
