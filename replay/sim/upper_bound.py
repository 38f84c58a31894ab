"""An upper bound on the goodput any scheduler can reach on a trace and a fleet.

The bound is a relaxation: it counts the most requests that could meet both SLOs if every
scheduling problem were solved perfectly and in hindsight (arrivals and true output lengths
known), and drops every constraint that would only lower that count. Each request gets its
cheapest conceivable cost:

- **prefill**: as if every block of its prompt that ANY earlier request carried were cached on
  the instance that runs it (one infinite cache shared by the fleet, free transfers), and as if
  it shared its step's fixed overhead with others for free — so ``b*n + c*n*(cached + n/2)`` of
  the engine's step model (``replay/engine/timing.py``) is charged, nothing else; except where
  the fleet's engines cannot share a prefill step (``prefill_alone``: unchunked prefill
  instances run one prompt per step and no decode), which is charged its whole step;
- **decode**: each generated token at the per-token cost of the largest batch whose step still
  meets the TBT SLO (ignoring the context term in that test; per-token cost falls with the
  batch and is convex in it, so a mean TBT within the SLO cannot do better on average), plus
  its own context term; and its context's KV held for at least the shortest step per token.
  Where the context term dominates a step (long prompts, a large per-token KV cost), that first
  form is loose: it lets the step's fixed cost F be shared by a batch whose contexts could never
  fit one TBT. The second form (``decode_share_costs``) keeps the contexts: if a served set A
  decodes m_i tokens per request with a step cost of at least w_i = b + k * prompt_i each, the
  mean-TBT SLO tau summed over A gives sum_i w_i m_i Bbar_i <= (tau - F) sum_i m_i (Bbar_i: the
  mean batch i decodes in), so the steps A needs cost at least
  F * (sum_i m_i sqrt(w_i))^2 / ((tau - F) * sum_i m_i) (Cauchy-Schwarz). That is not a sum over
  requests; its tangent ``u^2/v >= 2*alpha*u - alpha^2*v``, valid for every alpha, is, so each
  alpha gives per-request costs whose window count is a bound; the smallest over a grid of
  alphas and the first form is used.

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

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from config.settings import Settings
from predictors.profiles import EngineProfile, get_profile
from replay.engine.timing import StepTiming
from replay.sim.fleet import FleetSpec
from replay.workload.traces import BLOCK_SIZE, TraceRequest

ALPHA_QUANTILES = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)


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


def fixed_step_s(timing: StepTiming) -> float:
    """A decode step's cost before its first sequence (F)."""
    return timing.overhead_s + timing.a_s


def _decode_batch(timing: StepTiming, tbt_slo_s: float, max_batch: int) -> int:
    """Largest batch whose step (without context) fits the TBT SLO; at least 1."""
    fixed = fixed_step_s(timing)
    budget = tbt_slo_s - fixed
    if timing.b_s <= 0:
        return max_batch
    fit = int(budget / timing.b_s) if budget > 0 else 1
    return max(1, min(max_batch, fit))


@dataclass(frozen=True, slots=True)
class DecodeTerms:
    """One request's decode in the bound's cost model: ``steps`` tokens after the first, over
    ``context`` tokens of context summed over those steps, each step costing it at least
    ``floor_w`` (b + k * prompt); ``variable`` is its per-token and context part (b * steps +
    k * context)."""

    steps: int
    context: float
    floor_w: float
    variable: float


def decode_terms(r: TraceRequest, timing: StepTiming) -> DecodeTerms:
    steps = max(r.output_length - 1, 0)
    context = r.input_length * steps + steps * (steps + 1) / 2  # summed over its steps
    return DecodeTerms(
        steps,
        context,
        timing.b_s + timing.k_s * r.input_length,
        steps * timing.b_s + timing.k_s * context,
    )


@dataclass(slots=True)
class DecodeSetSums:
    """Running sums over a set of ``DecodeTerms``; ``cost`` is the least decode machine time
    the set needs within the mean-TBT SLO tau: its variable parts plus
    F * (sum m_i sqrt(w_i))^2 / ((tau - F) * sum m_i) of fixed step cost (the module
    docstring); ``inf`` where no step can meet the SLO (tau <= F) and anything decodes."""

    variable: float = 0.0
    steps: float = 0.0
    weighted: float = 0.0  # sum m_i * sqrt(w_i)

    def add(self, t: DecodeTerms) -> None:
        self.variable += t.variable
        self.steps += t.steps
        self.weighted += t.steps * math.sqrt(t.floor_w)

    def cost(self, fixed_s: float, tbt_slo_s: float) -> float:
        if not self.steps:
            return self.variable
        if tbt_slo_s <= fixed_s:
            return math.inf
        share = fixed_s * self.weighted * self.weighted / ((tbt_slo_s - fixed_s) * self.steps)
        return self.variable + share


def decode_set_cost(terms: Iterable[DecodeTerms], fixed_s: float, tbt_slo_s: float) -> float:
    """``DecodeSetSums.cost`` of ``terms``."""
    sums = DecodeSetSums()
    for t in terms:
        sums.add(t)
    return sums.cost(fixed_s, tbt_slo_s)


def decode_share_costs(
    steps: Sequence[int], floor_w: Sequence[float], fixed_s: float, tbt_slo_s: float
) -> list[list[float]]:
    """Per alpha of a grid, each request's share of the steps' fixed cost F (see the module
    docstring): ``K * m_i * (2 * alpha * sqrt(w_i) - alpha^2)`` with K = F / (tau - F). Empty
    where no step can meet the SLO's mean anyway (tau <= F) or nothing decodes."""
    if tbt_slo_s <= fixed_s or not any(steps):
        return []
    scale = fixed_s / (tbt_slo_s - fixed_s)
    roots = sorted(math.sqrt(w) for m, w in zip(steps, floor_w, strict=True) if m > 0)
    # alpha at the served set's step-weighted mean of sqrt(w) makes the tangent exact; the
    # quantiles of sqrt(w) cover where that mean can fall.
    alphas = sorted({roots[int(q * (len(roots) - 1))] for q in ALPHA_QUANTILES})
    return [
        [
            scale * m * (2 * alpha * math.sqrt(w) - alpha * alpha)
            for m, w in zip(steps, floor_w, strict=True)
        ]
        for alpha in alphas
    ]


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
    prefill_alone: bool = False,
) -> GoodputBound:
    """``prefill_alone``: every prompt is prefilled in a step of its own (a P/D fleet without
    chunked prefill or conditional disaggregation), so its step's fixed cost is its own."""
    timing = StepTiming.from_profile(profile, overhead_ms)
    batch = _decode_batch(timing, tbt_slo_s, max_batch or profile.max_batch)
    fixed = fixed_step_s(timing)
    per_token = (fixed + timing.b_s * max(batch, timing.t0)) / batch
    min_step = fixed + timing.b_s * timing.t0
    own_steps = prefill_alone and not colocated  # colocated engines mix prefill into decode
    hits = infinite_cache_hits(trace)
    prefill, decode, kv = [], [], []
    variable, steps_of, floor_w = [], [], []  # decode: per-token-and-context part, m_i, w_i
    feasible = 0
    for r, cached in zip(trace, hits, strict=True):
        n = r.input_length - cached
        alone = timing.prefill(n, cached)
        if alone > ttft_slo_s:
            continue
        feasible += 1
        t_first = r.arrival_s + ttft_slo_s
        terms = decode_terms(r, timing)
        steps = terms.steps
        end = t_first + steps * tbt_slo_s
        shared = timing.b_s * n + timing.c_s * n * (cached + n / 2)
        prefill.append(Job(r.arrival_s, t_first, alone if own_steps else shared))
        decode.append(Job(r.arrival_s, end, steps * per_token + timing.k_s * terms.context))
        variable.append(terms.variable)
        steps_of.append(steps)
        floor_w.append(terms.floor_w)
        kv.append(Job(r.arrival_s, end, (r.input_length + steps / 2) * steps * min_step))
    # The decode cost in its two forms: one job list per form, the smallest count wins.
    forms = [decode] + [
        [replace(d, cost=v + share) for d, v, share in zip(decode, variable, shares, strict=True)]
        for shares in decode_share_costs(steps_of, floor_w, fixed, tbt_slo_s)
    ]
    by_resource: dict[str, int] = {}
    if colocated:
        by_resource["prefill"] = resource_bound(prefill, colocated)
        by_resource["machine_time"] = min(
            resource_bound(
                [
                    Job(p.release_s, d.deadline_s, p.cost + d.cost)
                    for p, d in zip(prefill, form, strict=True)
                ],
                colocated,
            )
            for form in forms
        )
        by_resource["decode_kv"] = resource_bound(kv, colocated * profile.kv_capacity_tokens)
    else:
        by_resource["prefill"] = resource_bound(prefill, prefill_instances)
        by_resource["decode"] = min(resource_bound(form, decode_instances) for form in forms)
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


def fleet_bound(
    trace: Sequence[TraceRequest],
    fleet: FleetSpec,
    settings: Settings,
    *,
    local_prefill: bool = False,
) -> GoodputBound:
    """``goodput_bound`` for a simulated fleet under ``settings``' SLOs and step overhead.
    ``local_prefill``: conditional disaggregation may prefill on the decode instances too, in
    mixed steps (so prompts then share their step's fixed cost)."""
    return goodput_bound(
        trace,
        get_profile(fleet.profile),
        prefill_instances=fleet.prefill + (fleet.decode if local_prefill else 0),
        prefill_alone=fleet.chunk_tokens is None and not local_prefill,
        decode_instances=fleet.decode,
        colocated=fleet.colocated,
        ttft_slo_s=settings.slo.ttft_s,
        tbt_slo_s=settings.slo.tbt_s,
        overhead_ms=settings.predictors.overhead_ms,
        max_batch=fleet.max_batch,
    )


def fraction_of_bound(goodput_rps: float | None, bound: GoodputBound) -> float | None:
    if goodput_rps is None or bound.goodput_rps <= 0:
        return None
    return goodput_rps / bound.goodput_rps


__all__ = [
    "DecodeSetSums",
    "DecodeTerms",
    "GoodputBound",
    "Job",
    "decode_set_cost",
    "decode_share_costs",
    "decode_terms",
    "fixed_step_s",
    "fleet_bound",
    "fraction_of_bound",
    "goodput_bound",
    "infinite_cache_hits",
    "resource_bound",
    "window_count",
]
