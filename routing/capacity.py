"""How many instances each pool needs to meet the SLOs at the demand seen lately.

The gateway feeds a ``DemandWindow`` with what it admitted (prompt tokens, the tokens its
placement found cached, the output tokens the output-length predictor expects, the pools the
request went to) and how many requests it turned away; ``instances_needed`` turns the window
and each pool's predictors into an instance count. Pure: time is an argument.

The formula (per pool, over the window's span ``T`` seconds):

Prefill. Each admitted request costs ``S_i = prefill.predict(prompt_i - cached_i, cached_i)``
seconds on one instance, so the pool must supply ``R = sum(S_i) / T`` prefill-seconds per
second. An instance kept at utilisation ``u`` is taken as an M/G/1 FCFS queue: a request waits
with probability ``u``, and then for an exponential time with the Pollaczek-Khinchine mean
``r / (1 - u)``, ``r = E[S^2] / (2 E[S])`` the mean residual service time; so
``P(wait > t) = u * exp(-t (1 - u) / r)`` (exact for M/M/1). Request ``i`` meets the TTFT SLO
if it waits less than its budget ``b_i = ttft_slo - S_i``. The target ``u*`` is the highest
utilisation (at most ``max_utilisation``) at which the predicted share of requests that miss,
``mean_i u exp(-b_i (1 - u) / r)``, is at most ``ttft_miss_share`` (5 %: 95 % of requests
within the SLO), counted over the requests that can meet the SLO at all (``S_i < ttft_slo``;
no instance count helps the others). The pool needs ``R / u*`` instances. Treating each
instance as one queue fed a random share is pessimistic for kvgate, which sends each request
where it starts soonest; the KV transfer to decode is left out (small next to a prefill).

Decode. Each request decodes ``o_i`` tokens, so the pool must produce ``D = sum(o_i) / T``
tokens per second. A running sequence holds on average ``c = sum(o_i (p_i + o_i / 2)) /
sum(o_i)`` context tokens (its prompt plus half its output, weighted by how long it decodes).
With the step model ``step(B) = a + b B + k B c``, the largest batch one instance can run is
``B* = min(floor((tbt_slo - a) / (b + k c)), floor(kv_capacity / c), max_batch)`` (the TBT
SLO, the KV cache, the engine's sequence limit), where it makes ``B* / step(B*)`` tokens per
second; the pool needs ``D`` divided by that.

Colocated pools (role ``both``) add the two: ``R / u* + D / (B* / step(B*))``. That ignores
the gain of mixing prefill chunks into decode steps, so it errs on the side of more instances.

Requests turned away (admission, no healthy instance) are demand too, but their sizes are not
booked: they count as the mean admitted request of the window (every pool's ``R`` and ``D``
scaled by ``(admitted + turned away) / admitted``). If the window turned everything away, no
size is known and the answer is one more instance than the pool has.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from config.settings import Role
from predictors.decode import DecodeStepModel
from predictors.prefill import PrefillTimeModel

DEFAULT_WINDOW_S = 10.0
# u* never goes above this: even a generous TTFT SLO keeps 10 % headroom for bursts.
DEFAULT_MAX_UTILISATION = 0.9
# The share of requests (of those that can meet it) predicted to miss the TTFT SLO by queueing.
DEFAULT_TTFT_MISS_SHARE = 0.05
_MIN_SPAN_S = 1.0  # a window just started is not divided by a few milliseconds
_EPS = 1e-9  # 2.0000000001 instances are 2


@dataclass(frozen=True, slots=True)
class DemandSample:
    """One admitted request as the gateway placed it."""

    at_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int  # expected (predicted) output tokens
    prefill_pool: str
    decode_pool: str


@dataclass(frozen=True, slots=True)
class PoolModel:
    """What one instance of a pool can do (pools are taken as homogeneous)."""

    name: str
    role: Role
    instances: int  # instances taking traffic now
    prefill: PrefillTimeModel
    decode: DecodeStepModel
    kv_capacity_tokens: int
    max_batch: int


@dataclass(frozen=True, slots=True)
class PoolNeed:
    pool: str
    instances: int
    needed: int
    load_instances: float  # the unrounded count
    prefill_load_s_per_s: float  # R
    prefill_utilisation_target: float  # u*
    ttft_reachable: bool  # False: every request's prefill alone is longer than the TTFT SLO
    decode_tokens_per_s: float  # D
    decode_batch_limit: int  # B*
    decode_tokens_per_s_per_instance: float
    tbt_reachable: bool  # False: a batch of one already breaks the TBT SLO


class DemandWindow:
    """The last ``window_s`` seconds of admitted requests and refusals (oldest dropped)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[DemandSample] = deque()
        self._refused: deque[tuple[float, int]] = deque()
        self._started_s: float | None = None

    def start(self, now: float) -> None:
        """The moment observation began (a younger window divides by its own age)."""
        if self._started_s is None:
            self._started_s = now

    def add(self, sample: DemandSample) -> None:
        self.start(sample.at_s)
        self._samples.append(sample)

    def add_refused(self, at_s: float, count: int) -> None:
        """``count`` requests turned away at ``at_s`` (their sizes are unknown)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.start(at_s)
        if count:
            self._refused.append((at_s, count))

    def prune(self, now: float) -> None:
        lo = now - self.window_s
        while self._samples and self._samples[0].at_s < lo:
            self._samples.popleft()
        while self._refused and self._refused[0][0] < lo:
            self._refused.popleft()

    def span(self, now: float) -> float:
        """Seconds the window covers: its length, or less while it is younger than that."""
        age = now - self._started_s if self._started_s is not None else 0.0
        return max(min(self.window_s, age), _MIN_SPAN_S)

    def samples(self) -> tuple[DemandSample, ...]:
        return tuple(self._samples)

    def refused(self) -> int:
        return sum(n for _, n in self._refused)


def wait_exceeds(utilisation: float, t_s: float, residual_s: float) -> float:
    """``P(wait > t) = u exp(-t (1 - u) / r)``: an M/G/1 wait is zero with probability
    ``1 - u``, else taken as exponential with mean ``r / (1 - u)`` (Pollaczek-Khinchine)."""
    return utilisation * math.exp(-t_s * (1.0 - utilisation) / residual_s)


def prefill_utilisation_target(
    service_s: Sequence[float], ttft_slo_s: float, miss_share: float, max_utilisation: float
) -> tuple[float, bool]:
    """``u*`` (see the module docstring) for requests of prefill times ``service_s``; and
    whether any of them can meet the SLO (if none can, ``max_utilisation`` is returned)."""
    if not service_s:
        return max_utilisation, True
    budgets = [ttft_slo_s - s for s in service_s if s < ttft_slo_s]
    if not budgets:
        return max_utilisation, False
    total = sum(service_s)
    residual = sum(s * s for s in service_s) / (2.0 * total) if total > 0 else 0.0
    if residual <= 0:  # free prefills never queue
        return max_utilisation, True

    def missed(u: float) -> float:  # increasing in u: bisection finds where it meets the share
        return sum(wait_exceeds(u, b, residual) for b in budgets) / len(budgets)

    if missed(max_utilisation) <= miss_share:
        return max_utilisation, True
    lo, hi = 0.0, max_utilisation
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if missed(mid) <= miss_share else (lo, mid)
    return lo, True


def decode_batch_limit(
    model: DecodeStepModel,
    tbt_slo_s: float,
    mean_context_tokens: float,
    kv_capacity_tokens: int,
    max_batch: int,
) -> tuple[int, bool]:
    """``B*``: the largest batch within the TBT SLO, the KV cache and the sequence limit (at
    least 1); and whether the TBT SLO is reachable with a batch of one."""
    fixed_s = (model.a_ms + model.overhead_ms) / 1000.0
    per_seq_s = (model.b_ms + model.k_ms * mean_context_tokens) / 1000.0
    by_tbt = math.floor((tbt_slo_s - fixed_s) / per_seq_s) if per_seq_s > 0 else max_batch
    by_kv = math.floor(kv_capacity_tokens / mean_context_tokens) if mean_context_tokens > 0 else 0
    limits = [by_tbt, max_batch] + ([by_kv] if mean_context_tokens > 0 else [])
    return max(1, min(limits)), by_tbt >= 1


def instances_needed(
    window: DemandWindow,
    pools: list[PoolModel],
    now: float,
    *,
    ttft_slo_s: float,
    tbt_slo_s: float,
    ttft_miss_share: float = DEFAULT_TTFT_MISS_SHARE,
    max_utilisation: float = DEFAULT_MAX_UTILISATION,
) -> dict[str, PoolNeed]:
    """Per pool, the instances needed for the window's demand (see the module docstring)."""
    window.prune(now)
    span = window.span(now)
    samples = window.samples()
    refused = window.refused()
    scale = (len(samples) + refused) / len(samples) if samples else 1.0
    out: dict[str, PoolNeed] = {}
    for pool in pools:
        prefill_s = [
            pool.prefill.predict(s.prompt_tokens - s.cached_tokens, s.cached_tokens)
            for s in samples
            if s.prefill_pool == pool.name
        ]
        decodes = [s for s in samples if s.decode_pool == pool.name]
        util, ttft_ok = prefill_utilisation_target(
            prefill_s, ttft_slo_s, ttft_miss_share, max_utilisation
        )
        load_p = scale * sum(prefill_s) / span
        tokens = sum(s.output_tokens for s in decodes)
        ctx = (
            sum(s.output_tokens * (s.prompt_tokens + s.output_tokens / 2) for s in decodes) / tokens
            if tokens
            else 0.0
        )
        batch, tbt_ok = decode_batch_limit(
            pool.decode, tbt_slo_s, ctx, pool.kv_capacity_tokens, pool.max_batch
        )
        step = pool.decode.step_time(batch, round(batch * ctx))
        per_instance = batch / step if step > 0 else 0.0
        load_d = scale * tokens / span
        load = 0.0
        if pool.role is not Role.DECODE:
            load += load_p / util
        if pool.role is not Role.PREFILL and per_instance > 0:
            load += load_d / per_instance
        needed = math.ceil(load - _EPS) if load > 0 else 0
        if not samples and refused:  # everything turned away: no size known, ask for one more
            needed = pool.instances + 1
        out[pool.name] = PoolNeed(
            pool=pool.name,
            instances=pool.instances,
            needed=needed,
            load_instances=load,
            prefill_load_s_per_s=load_p,
            prefill_utilisation_target=util,
            ttft_reachable=ttft_ok,
            decode_tokens_per_s=load_d,
            decode_batch_limit=batch,
            decode_tokens_per_s_per_instance=per_instance,
            tbt_reachable=tbt_ok,
        )
    return out
