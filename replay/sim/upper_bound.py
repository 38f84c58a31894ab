"""An upper bound on the goodput any scheduler can reach on a trace and a fleet.

The bound is a relaxation: it counts the most requests that could meet both SLOs if every
scheduling problem were solved perfectly and in hindsight (arrivals and true output lengths
known), and drops every constraint that would only lower that count. Each request gets its
cheapest conceivable cost:

- **prefill**: as if every block of its prompt that ANY earlier request carried were cached on
  the instance that runs it (one infinite cache shared by the fleet, free transfers), and as if
  it shared its step's fixed overhead with others for free — so ``b*n + c*n*(cached + n/2)`` of
  the engine's step model (``replay/engine/timing.py``) is charged, nothing else;
- **decode**: each generated token at the per-token cost of the largest batch whose step still
  meets the TBT SLO (ignoring the context term in that test; per-token cost falls with the
  batch and is convex in it, so a mean TBT within the SLO cannot do better on average), plus
  its own context term; and its context's KV held for at least the shortest step per token.

A request whose prefill alone cannot meet the TTFT SLO is dropped. The rest compete for
machine time: a request must be prefilled in ``[arrival, arrival + SLO_ttft]`` and decoded by
``arrival + SLO_ttft + (output - 1) * SLO_tbt`` (a mean TBT within the SLO). Cut the timeline
into disjoint windows; the requests whose whole interval lies in one window must fit that
window's machine time, so at most the cheapest ones that fit can be served (taking the cheapest
first maximizes a count under one capacity), and a request that crosses a window edge is
counted as served. The sum over windows, for the prefill pool, the decode pool's time and its
KV, is an upper bound for each; the smallest over several window lengths and offsets, and over
the three resources, is the bound reported. A colocated fleet charges prefill and decode to the
same machines. It is loose where the relaxations are (real batching, cache capacity, transfer
time), never below what a real schedule achieves; the tests check it against simulated runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from predictors.profiles import EngineProfile
from replay.engine.timing import StepTiming
from replay.workload.traces import BLOCK_SIZE, TraceRequest


@dataclass(frozen=True, slots=True)
class Job:
    release_s: float
    deadline_s: float
    cost: float  # machine-seconds (or KV token-seconds) it needs at least


@dataclass(frozen=True, slots=True)
class GoodputBound:
    goodput_rps: float
    requests: int  # the most requests that could meet both SLOs
    feasible: int  # requests whose prefill alone meets the TTFT SLO
    total: int
    binding: str  # the resource that gave the smallest count
    by_resource: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return {
            "goodput_rps": self.goodput_rps,
            "requests": self.requests,
            "feasible": self.feasible,
            "total": self.total,
            "binding": self.binding,
            "by_resource": dict(self.by_resource),
        }


def infinite_cache_hits(trace: Iterable[TraceRequest], block_tokens: int = BLOCK_SIZE) -> list[int]:
    """Cached prompt tokens per request with one infinite cache: its leading blocks seen before."""
    seen: set[int] = set()
    out = []
    for r in trace:
        lead = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            lead += 1
        out.append(min(lead * block_tokens, max(r.input_length - 1, 0)))
        seen.update(r.hash_ids)
    return out


def window_count(jobs: Sequence[Job], machines: float, length_s: float, offset_s: float) -> int:
    """Most jobs that can finish inside their intervals on ``machines``, relaxed per window."""
    if not jobs:
        return 0
    start = min(j.release_s for j in jobs) - offset_s
    windows: dict[int, list[float]] = {}
    free = 0
    for j in jobs:
        k = int((j.release_s - start) // length_s)
        if j.deadline_s <= start + (k + 1) * length_s:
            windows.setdefault(k, []).append(j.cost)
        else:
            free += 1  # crosses a window edge: not constrained by this cut
    served = free
    capacity = machines * length_s
    for costs in windows.values():
        costs.sort()
        acc, n = 0.0, 0
        for c in costs:
            acc += c
            if acc > capacity:
                break
            n += 1
        served += n
    return served


def resource_bound(jobs: Sequence[Job], machines: float) -> int:
    """``window_count`` minimised over window lengths (multiples of the longest job interval)
    and offsets: every cut is a valid bound, the smallest is the tightest of them."""
    if not jobs:
        return 0
    span = max(j.deadline_s - j.release_s for j in jobs)
    best = len(jobs)
    for mult in (1, 2, 4, 8, 16):
        length = span * mult
        for frac in (0.0, 0.25, 0.5, 0.75):
            best = min(best, window_count(jobs, machines, length, frac * length))
    return best


def _decode_batch(timing: StepTiming, tbt_slo_s: float, max_batch: int) -> int:
    """Largest batch whose step (without context) fits the TBT SLO; at least 1."""
    fixed = timing.overhead_s + timing.a_s
    budget = tbt_slo_s - fixed
    if timing.b_s <= 0:
        return max_batch
    fit = int(budget / timing.b_s) if budget > 0 else 1
    return max(1, min(max_batch, fit))


def goodput_bound(
    trace: Sequence[TraceRequest],
    profile: EngineProfile,
    *,
    prefill_instances: int,
    decode_instances: int,
    colocated: int = 0,
    ttft_slo_s: float,
    tbt_slo_s: float,
    overhead_ms: float | None = None,
    max_batch: int | None = None,
) -> GoodputBound:
    timing = StepTiming.from_profile(profile, overhead_ms)
    batch = _decode_batch(timing, tbt_slo_s, max_batch or profile.max_batch)
    fixed = timing.overhead_s + timing.a_s
    per_token = (fixed + timing.b_s * max(batch, timing.t0)) / batch
    min_step = fixed + timing.b_s * timing.t0
    hits = infinite_cache_hits(trace)
    prefill, decode, kv = [], [], []
    feasible = 0
    for r, cached in zip(trace, hits, strict=True):
        n = r.input_length - cached
        alone = timing.prefill(n, cached)
        if alone > ttft_slo_s:
            continue
        feasible += 1
        t_first = r.arrival_s + ttft_slo_s
        end = t_first + max(r.output_length - 1, 0) * tbt_slo_s
        steps = max(r.output_length - 1, 0)
        context = r.input_length * steps + steps * (steps + 1) / 2  # summed over its steps
        prefill.append(
            Job(r.arrival_s, t_first, timing.b_s * n + timing.c_s * n * (cached + n / 2))
        )
        decode.append(Job(r.arrival_s, end, steps * per_token + timing.k_s * context))
        kv.append(Job(r.arrival_s, end, (r.input_length + steps / 2) * steps * min_step))
    by_resource: dict[str, int] = {}
    if colocated:
        both = [
            Job(p.release_s, d.deadline_s, p.cost + d.cost)
            for p, d in zip(prefill, decode, strict=True)
        ]
        by_resource["prefill"] = resource_bound(prefill, colocated)
        by_resource["machine_time"] = resource_bound(both, colocated)
        by_resource["decode_kv"] = resource_bound(kv, colocated * profile.kv_capacity_tokens)
    else:
        by_resource["prefill"] = resource_bound(prefill, prefill_instances)
        by_resource["decode"] = resource_bound(decode, decode_instances)
        by_resource["decode_kv"] = resource_bound(kv, decode_instances * profile.kv_capacity_tokens)
    binding = min(by_resource, key=lambda k: by_resource[k])
    count = by_resource[binding]
    duration = trace[-1].arrival_s - trace[0].arrival_s if trace else 0.0
    return GoodputBound(
        count / duration if duration > 0 else 0.0,
        count,
        feasible,
        len(trace),
        binding,
        by_resource,
    )


def fraction_of_bound(goodput_rps: float | None, bound: GoodputBound) -> float | None:
    if goodput_rps is None or bound.goodput_rps <= 0:
        return None
    return goodput_rps / bound.goodput_rps


__all__ = [
    "GoodputBound",
    "Job",
    "fraction_of_bound",
    "goodput_bound",
    "infinite_cache_hits",
    "resource_bound",
    "window_count",
]
