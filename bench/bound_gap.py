"""Where a run's distance from the goodput upper bound comes from (issue 11).

The bound (replay/sim/upper_bound.py) is a relaxation; a run below it may lose to it in
three places, which this splits on one simulated point:

- **decode** (where it binds): the bound packs the cheapest requests, knowing their true output
  lengths, into the decode pool's whole machine time. On the same cost model
  (``decode_set_cost``: the least machine time a set needs within the mean-TBT SLO) three sets
  are priced: the run's served requests (``served``), and two perfect packings of the pool's
  machine time over the arrival span, one picking by true decode cost
  (``clairvoyant_packing``), one by prompt length only, all admission can see of a request
  (``prompt_ranked_packing``). Each gives its rate, the least machine time it needs as a share
  of the pool's (``least_cost_share``: 1 - it is, for the run, what packing lost) and per
  request (``mean_cost_s``: how cheap the chosen requests are). Over a run of a few seconds
  the decodes that end after the last arrival can push a share over 1.
- **prefill**: the bound's prefill sees one infinite cache shared by the fleet. Each request
  the run turned away on its TTFT is classed by what the fleet's cache held when it was
  turned away (as the gateway's index saw it): infeasible even with the infinite cache (the
  bound drops those too), its prefix gone from the fleet (evicted, or never computed: the
  infinite cache remembers every request, also those turned away) so that a cold prefill
  misses the SLO, or within the SLO from the fleet's best prefix alone (queue, transfer or
  the class's headroom turned it away). ``prefill``: the prefill pool's machine time over the
  arrival span that the completed requests used (``busy_share``), that the served ones used
  (``served_share``), and that these would have used with the infinite cache's hits, all
  priced by the bound's prefill model.

Takes `kvgate sim`'s arguments (trace, fleet, profile, speed, SLOs, one `--policy` and
`--admission`, `--config`, `--ttft-after-transfer`); deterministic. The packings are greedy
fills of one capacity over the whole run (no time structure), references, not bounds.

    python -m bench.bound_gap ../shared/traces/conversation_trace.jsonl \\
        --profile llama2-70b-a100-tp8-2023 --speed 3 --ttft-slo 30 --policy kvcache_centric \\
        --admission predictive --ttft-after-transfer --json out/gap.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from config.errors import KvgateError
from config.settings import Settings
from predictors.profiles import get_profile
from replay.engine.timing import StepTiming
from replay.report.report import summarize
from replay.report.results import Outcome, RunResult
from replay.sim import sim_cli
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import SimOptions, Simulator
from replay.sim.upper_bound import (
    DecodeSetSums,
    DecodeTerms,
    decode_set_cost,
    decode_terms,
    fixed_step_s,
    fleet_bound,
    infinite_cache_hits,
)
from replay.workload.traces import BLOCK_SIZE, TraceRequest
from routing.types import Decision, Rejection, RejectReason, RequestInfo

# Rejection classes (TTFT rejections by what the fleet's cache held; the rest by reason).
INFEASIBLE = "infeasible_with_infinite_cache"
PREFIX_EVICTED = "prefix_evicted"  # computed for a request admitted earlier, gone since
PREFIX_NEVER_COMPUTED = "prefix_never_computed"  # only requests turned away carried it
FEASIBLE = "feasible_from_fleet_cache"


def packed_count(
    terms: Sequence[DecodeTerms],
    order: Sequence[int],
    capacity_s: float,
    fixed_s: float,
    tbt_slo_s: float,
) -> int:
    """How many requests, taken in ``order`` (indices into ``terms``), fit ``capacity_s`` of
    decode machine time priced by ``decode_set_cost``; stops at the first that does not fit."""
    sums = DecodeSetSums()
    n = 0
    for i in order:
        sums.add(terms[i])
        if sums.cost(fixed_s, tbt_slo_s) > capacity_s:
            break
        n += 1
    return n


def tangent_costs(terms: Sequence[DecodeTerms], fixed_s: float, tbt_slo_s: float) -> list[float]:
    """Each request's true decode cost as the bound prices it one by one: its variable part
    plus its share of the fixed step cost on the Cauchy-Schwarz tangent at alpha = the
    step-weighted mean of sqrt(w) over ``terms`` (replay/sim/upper_bound.py)."""
    steps = sum(t.steps for t in terms)
    if not steps or tbt_slo_s <= fixed_s:
        return [t.variable for t in terms]
    alpha = sum(t.steps * math.sqrt(t.floor_w) for t in terms) / steps
    scale = fixed_s / (tbt_slo_s - fixed_s)
    return [
        t.variable + scale * t.steps * (2 * alpha * math.sqrt(t.floor_w) - alpha * alpha)
        for t in terms
    ]


def _set_summary(
    chosen: Sequence[DecodeTerms], capacity_s: float, span_s: float, fixed_s: float, tau: float
) -> dict[str, float]:
    """A set of served requests: its rate, the least decode machine time it needs as a share
    of ``capacity_s``, and that time per request (how costly its requests are)."""
    cost = decode_set_cost(chosen, fixed_s, tau)
    return {
        "rps": round(len(chosen) / span_s, 4),
        "least_cost_share": round(cost / capacity_s, 4),
        "mean_cost_s": round(cost / len(chosen), 4) if chosen else 0.0,
    }


def _packing(
    terms: Sequence[DecodeTerms],
    key: Callable[[int], float],
    capacity_s: float,
    span_s: float,
    fixed_s: float,
    tau: float,
) -> dict[str, float]:
    order = sorted(range(len(terms)), key=key)
    n = packed_count(terms, order, capacity_s, fixed_s, tau)
    return _set_summary([terms[i] for i in order[:n]], capacity_s, span_s, fixed_s, tau)


def leading_hit(hash_ids: Sequence[int], seen: set[int], block_tokens: int, prompt: int) -> int:
    """Prompt tokens of the leading blocks in ``seen`` (at most all but the last token)."""
    lead = 0
    for h in hash_ids:
        if h not in seen:
            break
        lead += 1
    return min(lead * block_tokens, max(prompt - 1, 0))


def classify_rejection(
    prompt_tokens: int,
    infinite_hit: int,
    computed_hit: int,
    fleet_hit: int,
    timing: StepTiming,
    ttft_slo_s: float,
) -> str:
    """A TTFT rejection's class, from the prefill alone with each cache's hit: the infinite
    cache's (every earlier request), what the fleet had computed (the requests admitted
    before it) and what the fleet's best instance still held."""

    def fits(hit: int) -> bool:
        hit = min(hit, prompt_tokens - 1)
        return timing.prefill(prompt_tokens - hit, hit) <= ttft_slo_s

    if not fits(infinite_hit):
        return INFEASIBLE
    if fits(fleet_hit):
        return FEASIBLE
    return PREFIX_EVICTED if fits(computed_hit) else PREFIX_NEVER_COMPUTED


def run_recording(
    settings: Settings,
    fleet: FleetSpec,
    trace: list[TraceRequest],
    spec: sim_cli.RunSpec,
    options: SimOptions,
) -> tuple[RunResult, dict[str, int]]:
    """One simulated run, with the prompt tokens the gateway's index held cached on the best
    instance when it turned each request away."""
    sim = Simulator(sim_cli.with_spec(settings, spec), fleet, trace, options)
    conductor = sim.conductor
    schedule = conductor.schedule
    fleet_hit: dict[str, int] = {}

    def recording(req: RequestInfo, now: float, *args: Any, **kwargs: Any) -> Decision | Rejection:
        # Passed on whole: the recorder must not lag behind schedule's signature (it once did).
        decision = schedule(req, now, *args, **kwargs)
        if isinstance(decision, Rejection) and not kwargs.get("parked"):  # a retry counts nowhere
            best = conductor.index.match(req.block_hashes, now).best_blocks
            fleet_hit[req.request_id] = best * conductor.block_size
        return decision

    conductor.schedule = recording  # type: ignore[method-assign]
    start = time.perf_counter()
    result = sim.run()
    result.wall_s = time.perf_counter() - start
    return result, fleet_hit


def gap_report(args: argparse.Namespace, spec: sim_cli.RunSpec) -> dict[str, Any]:
    settings = sim_cli.base_settings(args)
    fleet = sim_cli.fleet_from(args, settings)
    trace = sim_cli.load_workload(args)
    if len(trace) < 2:
        raise ValueError("the selection left fewer than two requests")
    profile = get_profile(fleet.profile)
    ttft_slo, tbt_slo = settings.slo.ttft_s, settings.slo.tbt_s
    local = settings.routing.conditional_disagg  # prefills on decode instances too
    bound = fleet_bound(trace, fleet, settings, local_prefill=local)
    result, fleet_hit = run_recording(settings, fleet, trace, spec, sim_cli.sim_options(args))
    timing = StepTiming.from_profile(profile, settings.predictors.overhead_ms)
    fixed = fixed_step_s(timing)
    span = trace[-1].arrival_s - trace[0].arrival_s
    decoders = fleet.colocated or fleet.decode
    prefillers = fleet.colocated or fleet.prefill
    hits = infinite_cache_hits(trace)
    feasible = [
        i
        for i, r in enumerate(trace)
        if timing.prefill(r.input_length - hits[i], hits[i]) <= ttft_slo
    ]
    terms = [decode_terms(trace[i], timing) for i in feasible]
    capacity = decoders * span

    true_cost = tangent_costs(terms, fixed, tbt_slo).__getitem__

    served = [i for i, o in enumerate(result.requests) if o.meets_slo(ttft_slo, tbt_slo)]
    served_terms = [decode_terms(trace[i], timing) for i in served]
    classes: Counter[str] = Counter()
    prefill_s = served_s = served_inf_s = 0.0
    computed: set[int] = set()  # blocks of the requests admitted so far (trace order)
    for i, o in enumerate(result.requests):
        r = trace[i]
        if o.outcome is not Outcome.REJECTED:
            computed.update(r.hash_ids)
            if o.outcome is Outcome.COMPLETED:
                took = timing.prefill(r.input_length - o.cached_tokens, o.cached_tokens)
                prefill_s += took
                if o.meets_slo(ttft_slo, tbt_slo):
                    served_s += took
                    served_inf_s += timing.prefill(r.input_length - hits[i], hits[i])
        elif o.reason == RejectReason.TTFT_SLO.value:
            classes[
                classify_rejection(
                    r.input_length,
                    hits[i],
                    leading_hit(r.hash_ids, computed, BLOCK_SIZE, r.input_length),
                    fleet_hit.get(o.request_id, 0),
                    timing,
                    ttft_slo,
                )
            ] += 1
        else:
            classes[o.reason] += 1
    summary = summarize(result)
    rps = len(served) / span
    return {
        "label": result.label,
        "goodput_rps": round(rps, 4),
        "bound_rps": round(bound.goodput_rps, 4),
        "of_bound": round(rps / bound.goodput_rps, 4) if bound.goodput_rps else None,
        "bound_binding": bound.binding,
        "decode": {
            "capacity_s": round(capacity, 1),
            "served": _set_summary(served_terms, capacity, span, fixed, tbt_slo),
            "clairvoyant_packing": _packing(terms, true_cost, capacity, span, fixed, tbt_slo),
            "prompt_ranked_packing": _packing(
                terms, lambda j: trace[feasible[j]].input_length, capacity, span, fixed, tbt_slo
            ),
        },
        "prefill": {
            "busy_share": round(prefill_s / (prefillers * span), 4),
            "served_share": round(served_s / (prefillers * span), 4),
            "served_share_with_infinite_cache": round(served_inf_s / (prefillers * span), 4),
        },
        "rejections": dict(classes.most_common()),
        "run": {k: summary[k] for k in ("admitted", "rejected", "cache_hit_ratio", "tbt_p50_s")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bound_gap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim_cli.add_arguments(p)
    args = p.parse_args(argv)
    try:
        (spec,) = sim_cli.parse_run_specs(
            f"{args.policy or 'kvcache_centric'}+{args.admission or 'predictive'}", None
        )
        report = gap_report(args, spec)
    except (ValueError, KvgateError, KeyError, OSError) as exc:
        print(f"bench.bound_gap: {exc}", file=sys.stderr)
        return 2
    report.update(trace=args.trace, speed=args.speed)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
