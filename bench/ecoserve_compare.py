"""NoDG vs FuDG vs PaDG on one trace: EcoServe's goodput at P90 SLO attainment, simulated.

Same GPU count for every strategy (``--instances`` engine instances of ``--profile``):

* NoDG: all colocated, ``least_load`` (vLLM-style chunked prefill mixes prefills and decodes);
* FuDG: ``--instances`` split into prefill + decode pools, ``kvcache_centric`` (Mooncake),
  every prompt's KV crosses the network to its decode instance (``--ratios`` P:D splits are
  tried and the best is reported, as EcoServe picks MoonCake's best P/D ratio);
* PaDG: all colocated in macro instances of ``--macro-size``, ``rolling_activation``; once
  with EcoServe's windows (bounded by the TTFT SLO) and once with ``--window`` seconds.

Goodput (EcoServe §5.2) = the highest request rate at which >= ``--target`` of the requests
meet both SLOs (TTFT, and mean TPOT of the request). The rate is the trace's replay speed
factor: the speed is doubled/halved to bracket the crossing, then bisected ``--iters`` times.
Rejected and failed requests count as misses; admission is off for every strategy.

TTFT ends when the first token can be streamed to the client (``ttft_after_transfer``): for
FuDG that is when the KV reached the decode instance, as EcoServe counts the phase-switching
wait in TTFT; TPOT starts there. Colocated strategies move no KV between instances, so the
link bandwidth changes only FuDG (NoDG/PaDG are run once and shown under every link).

    python -m bench.ecoserve_compare --trace /work/shared/traces/conversation_trace.jsonl \\
        --limit 3000 --ttft-slo 15 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from config.settings import (
    AdmissionMode,
    PredictorSettings,
    RoutingSettings,
    Settings,
    SLOSettings,
    frozen_mapping,
)
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import SimOptions, Simulator
from replay.workload.traces import TraceRequest, load_trace, select


@dataclass(frozen=True)
class Strategy:
    name: str
    policy: str
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    uses_link: bool = False
    replication: bool = False


@dataclass
class Point:
    speed: float
    rate_rps: float
    attainment: float
    ttft_miss: float
    tpot_miss: float
    rejected: float
    goodput_rps: float


def load_requests(trace: str, limit: int | None, seed: int) -> list[TraceRequest]:
    if trace == "synthetic:chat":
        from replay.workload.synthetic import chat_spec, generate

        return generate(chat_spec(requests=limit or 3000, seed=seed))
    return select(load_trace(trace), limit=limit)


def settings_for(args: argparse.Namespace, s: Strategy, gbps: float) -> Settings:
    base = Settings(
        slo=SLOSettings(ttft_s=args.ttft_slo, tbt_s=args.tpot_slo),
        predictors=PredictorSettings(profile=args.profile, link_bandwidth_gbps=gbps),
        routing=RoutingSettings(
            policy=s.policy,
            params=frozen_mapping(s.params),
            block_size=args.block_size,
            seed=args.seed,
        ),
    )
    return replace(
        base,
        admission=replace(base.admission, mode=AdmissionMode.NONE),
        replication=replace(base.replication, enabled=s.replication),
    )


def run_point(
    args: argparse.Namespace, s: Strategy, gbps: float, reqs: list[TraceRequest], speed: float
) -> Point:
    trace = select(reqs, speed=speed)
    fleet = FleetSpec(
        prefill=s.prefill, decode=s.decode, colocated=s.colocated, profile=args.profile
    )
    sim = Simulator(settings_for(args, s, gbps), fleet, trace, SimOptions(ttft_after_transfer=True))
    run = sim.run()
    n = max(len(run.requests), 1)
    ttft, tpot = args.ttft_slo, args.tpot_slo
    good = sum(r.meets_slo(ttft, tpot) for r in run.requests)
    span = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
    return Point(
        speed=speed,
        rate_rps=len(trace) / span,
        attainment=good / n,
        ttft_miss=sum(r.ttft_s is None or r.ttft_s > ttft for r in run.requests) / n,
        tpot_miss=sum(r.tbt_mean_s is not None and r.tbt_mean_s > tpot for r in run.requests) / n,
        rejected=sum(r.outcome.value != "completed" for r in run.requests) / n,
        goodput_rps=good / span,
    )


def search(
    args: argparse.Namespace, s: Strategy, gbps: float, reqs: list[TraceRequest]
) -> dict[str, Any]:
    """Highest speed with attainment >= target: bracket by doubling/halving, then bisect."""
    points: dict[float, Point] = {}

    def ok(speed: float) -> bool:
        if speed not in points:
            points[speed] = run_point(args, s, gbps, reqs, speed)
        return points[speed].attainment >= args.target

    lo, hi = None, None
    speed = args.start_speed
    for _ in range(12):
        if ok(speed):
            lo = speed
            if hi is not None:
                break
            speed *= 2
        else:
            hi = speed
            if lo is not None:
                break
            speed /= 2
    if lo is not None and hi is not None:
        for _ in range(args.iters):
            mid = (lo * hi) ** 0.5  # geometric: speeds span orders of magnitude
            if ok(mid):
                lo = mid
            else:
                hi = mid
    best = points[lo] if lo is not None else None
    return {
        "strategy": s.name,
        "link_gbps": gbps if s.uses_link else None,
        "fleet": f"{s.prefill}P+{s.decode}D" if s.uses_link else f"{s.colocated} colocated",
        "params": s.params,
        "speed": lo,
        "goodput_rps": best.rate_rps if best else 0.0,
        "at_best": best.__dict__ if best else None,
        "curve": [p.__dict__ for _, p in sorted(points.items())],
    }


def strategies(args: argparse.Namespace) -> list[Strategy]:
    n = args.instances
    out = [Strategy("NoDG", "least_load", colocated=n)]
    for ratio in args.ratios.split(","):
        p, d = (int(x) for x in ratio.split(":"))
        if p + d != n:
            raise SystemExit(f"--ratios {ratio}: P + D must equal --instances {n}")
        out.append(
            Strategy(f"FuDG {p}P+{d}D", "kvcache_centric", p, d, uses_link=True, replication=True)
        )
    macro = {"macro_size": args.macro_size, "max_macro": max(args.macro_size, 6)}
    out.append(Strategy("PaDG (EcoServe windows)", "rolling_activation", colocated=n, params=macro))
    out.append(
        Strategy(
            f"PaDG (window {args.window:g} s)",
            "rolling_activation",
            colocated=n,
            params={**macro, "max_window_s": args.window},
        )
    )
    return out


def table(rows: list[dict[str, Any]], links: list[float]) -> str:
    head = "| strategy | fleet | " + " | ".join(f"{g:g} Gbps goodput r/s" for g in links)
    head += " | attainment at best | TTFT / TPOT misses |"
    lines = [head, "|" + "---|" * (4 + len(links))]
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    for name in names:
        mine = [r for r in rows if r["strategy"] == name]
        cells = []
        for g in links:
            r = next((x for x in mine if x["link_gbps"] in (None, g)), None)
            cells.append(f"{r['goodput_rps']:.2f}" if r else "")
        best = max(mine, key=lambda r: r["goodput_rps"])["at_best"]
        att = f"{best['attainment']:.1%}" if best else "-"
        miss = f"{best['ttft_miss']:.1%} / {best['tpot_miss']:.1%}" if best else "-"
        fleet = mine[0]["fleet"]
        lines.append(f"| {name} | {fleet} | " + " | ".join(cells) + f" | {att} | {miss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace or 'synthetic:chat'")
    p.add_argument("--limit", type=int, help="first N requests (synthetic: N generated)")
    p.add_argument("--profile", default="llama3-70b-h100-tp4")
    p.add_argument("--instances", type=int, default=8, help="engine instances per strategy")
    p.add_argument("--ratios", default="4:4,6:2", help="FuDG prefill:decode splits to try")
    p.add_argument("--macro-size", type=int, default=4, help="PaDG instances per macro instance")
    p.add_argument("--window", type=float, default=1.0, help="PaDG capped window, seconds")
    p.add_argument("--links", default="10,200", help="link bandwidths in Gbit/s")
    p.add_argument("--ttft-slo", type=float, default=5.0, help="seconds (EcoServe Table 4)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (EcoServe Table 4)")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment (P90 = 0.9)")
    p.add_argument("--start-speed", type=float, default=1.0)
    p.add_argument("--iters", type=int, default=6, help="bisection steps after bracketing")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma list of strategy name prefixes to run (default: all)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    links = [float(x) for x in args.links.split(",")]
    reqs = load_requests(args.trace, args.limit, args.seed)
    rows = []
    start = time.perf_counter()
    wanted = [w.strip() for w in args.only.split(",")] if args.only else None
    for s in strategies(args):
        if wanted and not any(s.name.startswith(w) for w in wanted):
            continue
        for g in links if s.uses_link else links[:1]:
            row = search(args, s, g, reqs)
            rows.append(row)
            at = row["at_best"]
            print(
                f"{s.name:28s} link={g if s.uses_link else '-'!s:>5} speed={row['speed']} "
                f"goodput={row['goodput_rps']:.2f} r/s attainment="
                f"{at['attainment'] if at else 0:.3f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    print()
    print(table(rows, links))
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"args": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
