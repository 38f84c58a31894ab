"""Admission mode ``peer``: the overload control each peer router ships, with upstream defaults.

- SMG / sglang router (``sglang_cache_aware``): ``middleware/token_bucket.rs`` + the
  concurrency-limit middleware (smg ``73da68ca``; defaults ``main.rs``): at most
  ``max_concurrent_requests`` in flight (a slot is held for the whole response stream) and a
  token bucket (burst = max_concurrent_requests, refill ``rate_limit_tokens_per_second``);
  a request that gets neither waits in a FIFO of ``queue_size`` for up to
  ``queue_timeout_secs``; queue full -> 429, timeout -> 408. Shipped default: -1 = off.
- GIE / llm-d (``llmd_weighted``): ``utilization-detector`` saturation detector: per endpoint
  max(waiting / queueDepthThreshold 5, kv / kvCacheUtilThreshold 0.8), pool saturation = mean,
  metrics older than 200 ms = saturated; when saturated (>= 1) *sheddable* requests
  (priority < 0) are rejected with 429 (``rejectIfSheddableAndSaturated``; flow control sheds
  the same requests at admission, llm-d-router PR #1968). llm-d's probabilistic admitter
  rejects sheddable requests with p = min(300 * saturation^5, 1).
- Dynamo (``dynamo_kv``): busy thresholds (``RouterConfig`` of ai-dynamo/dynamo's Python
  bindings; v1.1.1 defaults ``active_decode_blocks_threshold`` 1.0 and
  ``active_prefill_tokens_threshold_frac`` 10.0 per a deployment note, earlier releases leave
  them unset = off; see docs/peer-fidelity.md): a worker is busy when its active decode blocks
  exceed the fraction of its KV blocks, or its active prefill tokens exceed frac x
  ``max_num_batched_tokens``; when every eligible worker of a pool is busy the request is
  rejected (``AllEligibleWorkersOverloaded`` -> HTTP 529, here 429).

The simulator has no gateway-side queue: a request SMG would queue is admitted at once and
waits in the engine's queue instead (same FIFO wait; placement happens at arrival, not at
dequeue). See docs/peer-fidelity.md.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

from config.admission_settings import PeerOverloadSettings
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext
from routing.policies.peer_dynamo import DynamoKVPolicy
from routing.policies.peer_llmd import EngineMetrics
from routing.types import Rejection, RejectReason


@dataclass(frozen=True, slots=True)
class Verdict:
    """Why a peer turns a request away (None from ``check`` = admitted)."""

    message: str
    retry_after_s: float = 1.0


class PeerOverload(Protocol):
    def check(self, ctx: PlacementContext) -> Verdict | None: ...


def decode_side(ctx: PlacementContext) -> list[InstanceState]:
    """The instances whose books hold every in-flight request (decode, or colocated)."""
    return ctx.decode_candidates or ctx.prefill_candidates


def inflight_requests(ctx: PlacementContext) -> int:
    return sum(len(i.incoming) + len(i.running) for i in decode_side(ctx))


class SMGLimiter:
    """Concurrency slots + token-bucket rate budget + bounded FIFO (see module docstring)."""

    def __init__(self, s: PeerOverloadSettings) -> None:
        self.capacity = s.smg_max_concurrent_requests
        self.rate = s.smg_rate_limit_tokens_per_second or float(max(self.capacity, 1))
        self.queue_size = s.smg_queue_size
        self.timeout_s = s.smg_queue_timeout_s
        self.budget = float(max(self.capacity, 0))
        self._at: float | None = None

    def check(self, ctx: PlacementContext) -> Verdict | None:
        if self.capacity < 0:
            return None  # the shipped default: no limiter
        now = ctx.now
        if self._at is not None:
            self.budget = min(self.budget + (now - self._at) * self.rate, self.capacity)
        self._at = now
        inflight = inflight_requests(ctx)
        debt = 1.0 - self.budget  # > 0: must wait for the refill
        if inflight < self.capacity and debt <= 0:
            self.budget -= 1.0
            return None
        # It would wait in the FIFO. Already waiting there: the requests admitted beyond the
        # slots (they wait in an engine queue here) and those admitted on budget debt.
        waiting = max(inflight - self.capacity, 0) + max(math.ceil(-self.budget), 0)
        if waiting >= self.queue_size:
            return Verdict(f"SMG queue full ({self.queue_size} waiting): 429")
        if max(debt, 0.0) / self.rate > self.timeout_s:
            return Verdict(f"SMG queue timeout ({self.timeout_s:.0f} s): 408")
        self.budget -= 1.0
        return None


class GIESaturation:
    """GIE utilization saturation detector shedding sheddable requests (module docstring)."""

    def __init__(self, s: PeerOverloadSettings, seed: int) -> None:
        self.s = s
        self.metrics = EngineMetrics(s.gie_scrape_interval_s)
        self.rng = random.Random(seed)

    def saturation(self, ctx: PlacementContext) -> float:
        pods = [*ctx.prefill_candidates, *ctx.decode_candidates]
        if self.s.gie_scrape_interval_s > self.s.gie_metrics_staleness_s:
            return float("inf")  # every scrape is stale: the detector says saturated
        scores = [
            max(q / self.s.gie_queue_depth_threshold, kv / self.s.gie_kv_cache_util_threshold)
            for q, kv in self.metrics.get(pods, ctx.now)
        ]
        return sum(scores) / len(scores)

    def check(self, ctx: PlacementContext) -> Verdict | None:
        if not self.s.gie_sheddable:
            return None  # non-sheddable requests are never shed
        sat = self.saturation(ctx)
        if self.s.gie_admitter == "probabilistic":
            p = min(300.0 * sat**5, 1.0)
            if self.rng.random() < p:
                return Verdict(f"llm-d admitter shed (saturation {sat:.2f}, p {p:.2f}): 429")
            return None
        if sat >= 1.0:
            return Verdict(f"GIE pool saturated ({sat:.2f}), sheddable request: 429")
        return None


class DynamoBusy:
    """Dynamo busy thresholds: reject when every worker of a pool is busy (module docstring)."""

    def __init__(self, s: PeerOverloadSettings, policy: DynamoKVPolicy | None) -> None:
        self.s = s
        self.policy = policy or DynamoKVPolicy()

    def prefill_busy(self, inst: InstanceState) -> bool:
        limit = self.s.dynamo_active_prefill_tokens_threshold_frac
        return (
            self.policy.active_prefill_tokens(inst) > limit * self.s.dynamo_max_num_batched_tokens
        )

    def decode_busy(self, inst: InstanceState, block_size: int) -> bool:
        total = max(inst.capacity_tokens // block_size, 1)
        used = DynamoKVPolicy.active_decode_blocks(inst, block_size)
        return used > self.s.dynamo_active_decode_blocks_threshold * total

    def check(self, ctx: PlacementContext) -> Verdict | None:
        bs = ctx.block_size
        if ctx.decode_candidates:
            if all(self.prefill_busy(i) for i in ctx.prefill_candidates):
                return Verdict("Dynamo: all prefill workers busy (529)")
            if all(self.decode_busy(i, bs) for i in ctx.decode_candidates):
                return Verdict("Dynamo: all decode workers busy (529)")
            return None
        if all(self.prefill_busy(i) or self.decode_busy(i, bs) for i in ctx.prefill_candidates):
            return Verdict("Dynamo: all workers busy (529)")
        return None


PEER_POLICIES = ("sglang_cache_aware", "llmd_weighted", "dynamo_kv")

# ``kvgate sim --tune``: each peer's main overload knob (a PeerOverloadSettings field) and the
# values an operator would try, shipped default first (ties keep the earlier value).
PEER_TUNING: dict[str, tuple[str, tuple[float | int, ...]]] = {
    "sglang_cache_aware": (
        "smg_max_concurrent_requests",
        (-1, 8, 16, 32, 64, 96, 128, 192, 256),
    ),
    "llmd_weighted": ("gie_queue_depth_threshold", (5.0, 1.0, 2.0, 3.0, 8.0, 13.0, 20.0)),
    "dynamo_kv": (
        "dynamo_active_prefill_tokens_threshold_frac",
        (10.0, 1.0, 2.0, 3.0, 5.0, 7.0, 15.0, 20.0, 30.0),
    ),
}


def build_peer_overload(
    policy: object, settings: PeerOverloadSettings, seed: int = 0
) -> PeerOverload:
    """The overload control of the system ``policy`` re-implements."""
    name = getattr(policy, "name", "")
    if name == "sglang_cache_aware":
        return SMGLimiter(settings)
    if name == "llmd_weighted":
        return GIESaturation(settings, seed)
    if name == "dynamo_kv":
        return DynamoBusy(settings, policy if isinstance(policy, DynamoKVPolicy) else None)
    known = ", ".join(PEER_POLICIES)
    raise ValueError(f"admission 'peer' needs a peer policy ({known}), not {name!r}")


def peer_rejection(ctx: PlacementContext, verdict: Verdict, priority: str | None) -> Rejection:
    return Rejection(
        ctx.request.request_id,
        RejectReason.PEER_OVERLOAD,
        verdict.message,
        verdict.retry_after_s,
        priority=priority,
    )
