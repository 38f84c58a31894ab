"""What the OpenAI proxy needs of the running gateway: the seam between the hot path
(gateway/proxy.py, gateway/tenants.py) and the composition root (gateway/runtime.py).

The handler reads these and nothing else; a test or another front door (the endpoint picker
takes the same Gateway) can stand in anything that has them. Grouped by job: the core and its
clock, request parsing, the engine legs (targets, driver, timeouts, slot pins, leg health),
learning and replication, and the process's metrics, tracing and drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import aiohttp

from backends.drivers import ProtocolDriver, Target
from backends.legs import Failure
from config.settings import InstanceSettings, Settings
from gateway.drain import Drain
from gateway.learning import Learner
from gateway.metrics import GatewayMetrics
from gateway.openai import ParsedRequest, RequestHead
from gateway.replicator import Replicator
from gateway.response_owners import ResponseOwners
from gateway.tracing import Tracing
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RequestInfo


class DecodeWaitsLike(Protocol):
    """Where a request turned away on its TBT check waits for decode room
    (gateway/decode_waits.py)."""

    async def wait(
        self,
        rejection: Rejection,
        req: RequestInfo,
        screen: Callable[[Decision, RequestInfo, float], Decision | Rejection] | None = None,
    ) -> Decision | Rejection: ...


class LegOutcomes(Protocol):
    """Where a leg's outcome goes (gateway/leg_health.py: breakers, ejection, probes)."""

    def failed(self, instance_id: str, kind: Failure = ...) -> None: ...

    def succeeded(self, instance_id: str) -> None: ...


@runtime_checkable
class ProxyGateway(Protocol):
    # the core and its clock
    settings: Settings
    conductor: Conductor
    clock: Callable[[], float]
    # the engine legs
    targets: Mapping[str, Target]
    specs: Mapping[str, InstanceSettings]
    driver: ProtocolDriver
    session: aiohttp.ClientSession | None
    tenant_keys: Mapping[str, str]  # API key hash -> tenant (gateway/tenants.py)
    legs: LegOutcomes  # each leg's outcome: breakers, ejection, probes
    decode_waits: DecodeWaitsLike
    response_owners: ResponseOwners  # which instance made each Responses API answer
    # learning and replication
    learner: Learner
    replicator: Replicator
    # the process
    metrics: GatewayMetrics
    tracing: Tracing
    drain: Drain

    def parse_head(self, raw: bytes) -> RequestHead: ...

    async def tokenize_ahead(self, path: str, head: RequestHead) -> None: ...

    def parse_prompt(
        self, path: str, head: RequestHead, headers: Mapping[str, str], request_id: str
    ) -> ParsedRequest: ...

    def silence_timeout(self, d: Decision, whole_answer_tokens: int = 0) -> float: ...

    def pin_slot(self, request_id: str, instance_id: str, blocks: Sequence[int]) -> int | None: ...

    def unpin_slot(self, request_id: str) -> None: ...

    async def restore_slot(self, request_id: str) -> None: ...

    def cached_tokens(self, d: Decision) -> int: ...

    def cache_reported(self, request_id: str, now: float, answer_tail: bytes) -> None: ...
