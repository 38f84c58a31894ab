"""``kvgate sim sweep TRACE``: goodput, p90 TTFT and wasted prefills over load and TTFT SLO.

Every point (speed × TTFT SLO) runs each ``--compare`` entry through the simulator on the same
selection of the trace, and computes the goodput upper bound (``replay/sim/upper_bound.py``) for the
same trace, fleet and SLOs, so each row says how far each policy is from what is possible. The
JSON holds every summary plus the bound; the PNGs plot one panel per TTFT SLO (goodput with the
bound dashed, p90 TTFT, wasted-prefill ratio against speed). Deterministic: same inputs, same
numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from replay.report.progress import ProgressBar
from replay.sim.upper_bound import fleet_bound, fraction_of_bound
from replay.workload.traces import TraceError, select


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"{name} must be a comma list of positive numbers, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    from replay.sim.sim_cli import add_arguments as add_sim_args

    add_sim_args(p)
    p.add_argument("--speeds", default="0.5,1,1.5,2,2.5,3", help="comma list of speed factors")
    p.add_argument("--ttft-slos", default="5,10,30", help="comma list of TTFT SLOs (seconds)")
    p.add_argument(
        "--conditional-disagg",
        choices=("off", "on", "both"),
        default="off",
        help="routing.conditional_disagg for every run; 'both' runs each entry with it off "
        "and on (label suffix +cd)",
    )


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    from replay.report.report import summarize
    from replay.sim.sim_cli import (
        base_settings,
        fleet_from,
        load_workload,
        parse_run_specs,
        run_one,
        sim_options,
    )
    from routing.policies.registry import build_policy

    speeds = _floats(args.speeds, "--speeds")
    slos = _floats(args.ttft_slos, "--ttft-slos")
    specs = parse_run_specs(args.compare or args.policy, None)
    settings = base_settings(args)
    for spec in specs:
        build_policy(spec.policy, settings.routing.params)
    fleet = fleet_from(args, settings)
    fleet.validate()
    base = load_workload(replace_speed(args, 1.0))
    if not base:
        raise ValueError("the selection left no requests")
    options = sim_options(args)
    points: list[dict[str, Any]] = []
    bar = ProgressBar("kvgate sim sweep", enabled=not args.quiet)
    cd_values = {"off": (False,), "on": (True,), "both": (False, True)}[args.conditional_disagg]
    total = len(speeds) * len(slos) * len(specs) * len(cd_values)
    done = 0
    for speed in speeds:
        trace = select(base, speed=speed)
        for slo in slos:
            s = replace(settings, slo=replace(settings.slo, ttft_s=slo))
            bound = fleet_bound(trace, fleet, s, local_prefill=any(cd_values))
            runs = []
            for spec in specs:
                for cd in cd_values:
                    s_cd = replace(s, routing=replace(s.routing, conditional_disagg=cd))
                    result = run_one(s_cd, fleet, trace, spec, True, options)
                    summary = summarize(result)
                    if cd:
                        summary["label"] += "+cd"
                    summary["fraction_of_bound"] = fraction_of_bound(summary["goodput_rps"], bound)
                    runs.append(summary)
                    done += 1
                    bar(done, total)
            points.append(
                {"speed": speed, "ttft_slo_s": slo, "bound": bound.as_dict(), "runs": runs}
            )
    return {
        "trace": args.trace,
        "profile": fleet.profile,
        "fleet": {"prefill": fleet.prefill, "decode": fleet.decode, "colocated": fleet.colocated},
        "tbt_slo_s": settings.slo.tbt_s,
        "points": points,
    }


def replace_speed(args: argparse.Namespace, speed: float) -> argparse.Namespace:
    out = argparse.Namespace(**vars(args))
    out.speed = speed
    return out


def format_sweep(report: dict[str, Any]) -> str:
    lines = [
        f"{'speed':>5} {'TTFT SLO':>8} {'bound r/s':>9}  "
        f"{'run':<34} {'goodput':>8} {'of bound':>8} {'p90 TTFT':>9} {'wasted':>7}"
    ]
    for pt in report["points"]:
        for i, run in enumerate(pt["runs"]):
            head = (
                f"{pt['speed']:>5g} {pt['ttft_slo_s']:>8g} {pt['bound']['goodput_rps']:>9.2f}"
                if i == 0
                else " " * 24
            )
            frac = run.get("fraction_of_bound")
            p90 = run.get("ttft_p90_s")
            lines.append(
                f"{head}  {run['label']:<34} {run['goodput_rps'] or 0:>8.2f} "
                f"{'-' if frac is None else f'{frac:.0%}':>8} "
                f"{'-' if p90 is None else f'{p90:.2f}':>9} "
                f"{run.get('wasted_prefill_ratio') or 0:>7.1%}"
            )
    return "\n".join(lines)


def write_sweep_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    slos = sorted({pt["ttft_slo_s"] for pt in report["points"]})
    metrics = [
        ("goodput_rps", "goodput (req/s)"),
        ("ttft_p90_s", "p90 TTFT (s)"),
        ("wasted_prefill_ratio", "wasted prefills (share of admitted)"),
    ]
    paths = []
    for key, ylabel in metrics:
        fig, axes = plt.subplots(1, len(slos), figsize=(5 * len(slos), 4), squeeze=False)
        for ax, slo in zip(axes[0], slos, strict=True):
            pts = [pt for pt in report["points"] if pt["ttft_slo_s"] == slo]
            speeds = [pt["speed"] for pt in pts]
            labels = [r["label"] for r in pts[0]["runs"]]
            for j, label in enumerate(labels):
                ys = [pt["runs"][j].get(key) for pt in pts]
                ys_f = [float("nan") if y is None else y for y in ys]
                ax.plot(speeds, ys_f, marker="o", label=label)
            if key == "goodput_rps":
                bound = [pt["bound"]["goodput_rps"] for pt in pts]
                ax.plot(speeds, bound, "k--", label="upper bound")
            ax.set_title(f"TTFT SLO {slo:g} s")
            ax.set_xlabel("load (speed factor)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{Path(report['trace']).name} · {report['profile']}")
        fig.tight_layout()
        path = out_dir / f"sweep_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(args: argparse.Namespace) -> int:
    from config.loader import ConfigError
    from routing.policies.registry import PolicyError

    try:
        report = run_sweep(args)
    except (TraceError, ConfigError, PolicyError, ValueError, KeyError, OSError) as exc:
        print(f"kvgate sim sweep: {exc}", file=sys.stderr)
        return 2
    print(format_sweep(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        for path in write_sweep_plots(report, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    return 0
