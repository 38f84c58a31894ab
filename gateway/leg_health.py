"""How the outcomes of engine legs and health probes become an instance's health.

Each instance has a circuit breaker (backends/health.py). A refused connection opens it at
once (nothing listens: the engine is down); any other transport failure counts in it and has
the instance's ``/health`` probed now, so an engine killed mid-stream is found in
milliseconds, not one health interval later. An open breaker ejects the instance from the
Conductor's pools until the health checker sees it answer again; a success closes it. The
clock is the gateway's (monotonic seconds, injectable for tests).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from backends.circuit_breaker import BreakerConfig, CircuitBreaker
from backends.health import HealthChecker
from backends.legs import Failure
from gateway.metrics import GatewayMetrics
from routing.conductor import Conductor

log = logging.getLogger("kvgate.gateway")


class LegHealth:
    def __init__(
        self, conductor: Conductor, metrics: GatewayMetrics, clock: Callable[[], float]
    ) -> None:
        self.conductor = conductor
        self.metrics = metrics
        self.clock = clock
        self.breakers: dict[str, CircuitBreaker] = {}
        self.checker: HealthChecker | None = None  # set at startup (it needs the session)

    def add(self, instance_id: str) -> None:
        self.breakers[instance_id] = CircuitBreaker(BreakerConfig())
        self.metrics.healthy.labels(instance_id).set(1)

    def remove(self, instance_id: str) -> None:
        self.breakers.pop(instance_id, None)
        self.metrics.healthy.labels(instance_id).set(0)

    def changed(self, instance_id: str, healthy: bool) -> None:
        """The health checker's verdict (or an ejection by a breaker)."""
        if instance_id not in self.conductor.instances:
            return
        log.info("instance %s is now %s", instance_id, "healthy" if healthy else "unhealthy")
        self.conductor.set_health(instance_id, healthy)
        self.metrics.healthy.labels(instance_id).set(1 if healthy else 0)
        if healthy:
            self.breakers[instance_id] = CircuitBreaker(BreakerConfig())

    def failed(self, instance_id: str, kind: Failure = Failure.CONNECT) -> None:
        """A leg failed: count it; an open breaker ejects the instance."""
        breaker = self.breakers.get(instance_id)
        self.metrics.upstream_errors.labels(instance_id).inc()
        if breaker is None:
            return
        now = self.clock()
        if kind is Failure.REFUSED:
            breaker.trip(now)
        else:
            breaker.record_failure(now)
        if not breaker.allow(now):
            self.changed(instance_id, False)
            if self.checker is not None:
                self.checker.mark_unhealthy(instance_id)
        elif kind is not Failure.HTTP and self.checker is not None:
            self.checker.probe_now(instance_id)  # a killed engine refuses the probe: ejected

    def succeeded(self, instance_id: str) -> None:
        breaker = self.breakers.get(instance_id)
        now = self.clock()
        if breaker is not None:
            breaker.record_success(now)
        if self.checker is not None:
            self.checker.mark_alive(instance_id, now)
