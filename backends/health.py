"""Active ``/health`` polling of every instance.

It and the circuit breaker (backends/circuit_breaker.py) are deliberately separate signals:
the breaker reacts to failures of real traffic within seconds, the health checker catches an
engine that is down while it gets no traffic. The gateway marks an instance routable only
when both agree.

A refused connection is not like a slow answer: nothing listens on the port (the engine died
or was killed), so it ejects at once, both as a probe result and as a request's failure
(``CircuitBreaker.trip``). A probe that times out counts as one failure, and not even that
when real traffic to the instance succeeded meanwhile: a busy engine answers ``/health``
late (vLLM on CPU under load) but is alive. An ejected instance is probed more often than
the rest (Envoy's ``unhealthy_interval``), so an engine back from a stall rejoins within
seconds, not two full intervals later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from backends.stop_wait import wait_or_stop

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TargetHealth:
    healthy: bool | None = None  # None until the first check completes
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_checked_s: float | None = None
    last_error: str | None = None
    last_alive_s: float = float("-inf")  # last time real traffic got an answer from it


class HealthChecker:
    """Polls ``GET {url}/health`` for every target and reports health transitions.

    The first result decides an unknown target at once (traffic should not wait several
    intervals for a new instance); after that ``unhealthy_after`` consecutive failures or
    ``healthy_after`` consecutive successes are needed to flip, so one slow answer does not
    flap an instance in and out of the pool. A refused connection flips at once; a timeout is
    forgiven when real traffic got an answer from the instance since the previous probe.
    An ejected instance is probed every ``recheck_s`` (at most ``interval_s``) between rounds:
    it is the only way back in, and every second it stays out after its engine recovered is a
    second of refused requests when it is a pool's only instance.
    Defaults (SMG): 60 s interval, 5 s timeout.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        targets: Mapping[str, str],
        *,
        interval_s: float = 60.0,
        timeout_s: float = 5.0,
        recheck_s: float = 1.0,
        unhealthy_after: int = 3,
        healthy_after: int = 2,
        on_change: Callable[[str, bool], None],
        clock: Callable[[], float],
        path: str = "/health",
    ) -> None:
        if unhealthy_after < 1 or healthy_after < 1:
            raise ValueError("unhealthy_after and healthy_after must be >= 1")
        self._session = session
        self.set_timing(interval_s, timeout_s, recheck_s)
        self._unhealthy_after = unhealthy_after
        self._healthy_after = healthy_after
        self._on_change = on_change
        self._clock = clock
        self._path = path
        self._targets: dict[str, str] = {}
        self._health: dict[str, TargetHealth] = {}
        self._probing: dict[str, asyncio.Task[None]] = {}  # probe_now, one per instance
        self.set_targets(targets)

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    def set_timing(self, interval_s: float, timeout_s: float, recheck_s: float = 1.0) -> None:
        """New interval, timeout and recheck period (a configuration reload), from the next
        round on."""
        if interval_s <= 0 or timeout_s <= 0 or recheck_s <= 0:
            raise ValueError("interval_s, timeout_s and recheck_s must be positive")
        self.interval_s, self._timeout_s = interval_s, timeout_s
        self.recheck_s = min(recheck_s, interval_s)

    def mark_alive(self, instance_id: str, now: float) -> None:
        """Real traffic got an answer from the instance (a late probe is then not held
        against it)."""
        h = self._health.get(instance_id)
        if h is not None:
            h.last_alive_s = now

    def probe_now(self, instance_id: str) -> asyncio.Task[None] | None:
        """Probe one instance at once, off the schedule (a request's leg broke: is the engine
        gone?); at most one such probe per instance at a time. Needs a running loop."""
        url = self._targets.get(instance_id)
        if url is None:
            return None
        task = self._probing.get(instance_id)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._probe_one(instance_id, url))
            self._probing[instance_id] = task
        return task

    def cancel_probes(self) -> None:
        """Stop the off-schedule probes (shutdown)."""
        for task in self._probing.values():
            task.cancel()
        self._probing.clear()

    async def _probe_one(self, instance_id: str, url: str) -> None:
        started = self._clock()
        error, refused = await self._probe(url)
        h = self._health.get(instance_id)
        if h is not None:
            self._apply(instance_id, h, error, self._clock(), refused=refused, started=started)

    @property
    def status(self) -> Mapping[str, TargetHealth]:
        return self._health

    def healthy(self, instance_id: str) -> bool | None:
        h = self._health.get(instance_id)
        return h.healthy if h is not None else None

    def mark_unhealthy(self, instance_id: str) -> None:
        """Another signal (e.g. an open circuit breaker) ejected the instance: it must now pass
        ``healthy_after`` consecutive checks before it is reported healthy again."""
        h = self._health.get(instance_id)
        if h is not None:
            h.healthy = False
            h.consecutive_successes = 0

    def set_targets(self, targets: Mapping[str, str]) -> None:
        """Replace the target set; new targets start unknown, removed ones are forgotten."""
        self._targets = {iid: url.rstrip("/") for iid, url in targets.items()}
        for gone in set(self._health) - set(self._targets):
            del self._health[gone]
        for iid in self._targets:
            self._health.setdefault(iid, TargetHealth())

    def ejected(self) -> list[str]:
        """The targets currently held out (known unhealthy)."""
        return [iid for iid, h in self._health.items() if h.healthy is False]

    async def check_once(self, only: list[str] | None = None) -> dict[str, bool]:
        """Probe every target (or those in ``only``) concurrently; returns the
        (post-hysteresis) health of each probed."""
        # A snapshot: set_targets may run while we await.
        targets = {i: u for i, u in self._targets.items() if only is None or i in only}
        started = self._clock()
        results = await asyncio.gather(*(self._probe(url) for url in targets.values()))
        now = self._clock()
        out: dict[str, bool] = {}
        for iid, (error, refused) in zip(targets, results, strict=True):
            h = self._health.get(iid)
            if h is None:  # removed while probing
                continue
            self._apply(iid, h, error, now, refused=refused, started=started)
            out[iid] = bool(h.healthy)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Check every target every ``interval_s`` (start to start), and the ejected ones every
        ``recheck_s`` in between, until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        next_round = loop.time()
        while not stop.is_set():
            next_round = min(next_round, loop.time() + self.interval_s)  # a reload shortened it
            if loop.time() >= next_round:
                next_round = loop.time() + self.interval_s
                await self.check_once()
            else:
                await self.check_once(self.ejected())
            wake = next_round
            if self.ejected():
                wake = min(wake, loop.time() + self.recheck_s)
            await wait_or_stop(stop, wake - loop.time())

    async def _probe(self, base_url: str) -> tuple[str | None, bool]:
        """(``None`` when healthy, else why not; whether the connection was refused)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._session.get(base_url + self._path) as resp:
                    await resp.read()  # drain so the connection can be reused
                    return (None if 200 <= resp.status < 300 else f"HTTP {resp.status}"), False
        except TimeoutError:
            return f"timeout ({self._timeout_s:g} s)", False
        except aiohttp.ClientError as exc:
            refused = isinstance(getattr(exc, "os_error", None), ConnectionRefusedError)
            return f"{type(exc).__name__}: {exc}", refused

    def _apply(
        self,
        iid: str,
        h: TargetHealth,
        error: str | None,
        now: float,
        *,
        refused: bool = False,
        started: float | None = None,
    ) -> None:
        h.last_checked_s = now
        h.last_error = error
        if (
            error is not None
            and error.startswith("timeout")
            and started is not None
            and h.last_alive_s >= started - self.interval_s
        ):
            return  # slow to answer the probe, but it answered real traffic: busy, not down
        if error is None:
            h.consecutive_successes += 1
            h.consecutive_failures = 0
            flip = h.healthy is None or (
                not h.healthy and h.consecutive_successes >= self._healthy_after
            )
            new = True
        else:
            h.consecutive_failures += 1
            h.consecutive_successes = 0
            flip = h.healthy is None or (
                h.healthy and (refused or h.consecutive_failures >= self._unhealthy_after)
            )
            new = False
        if not flip:
            return
        h.healthy = new
        log.info("instance %s is now %s", iid, "healthy" if new else f"unhealthy ({error})")
        try:
            self._on_change(iid, new)
        except Exception:  # a consumer bug must not stop health tracking
            log.exception("health on_change callback failed for %s", iid)
