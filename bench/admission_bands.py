"""Who admission turns away, by prompt length: one simulated point run with and without the
decode reservation (routing/decode_reservation.py), and the admitted and SLO-met shares per
prompt-length band, so that a cost-aware admission can be checked for starving long prompts.

Takes `kvgate sim`'s arguments (trace, fleet, profile, speed, SLOs, one `--policy` and
`--admission`, `--config`, `--ttft-after-transfer`); deterministic.

    python -m bench.admission_bands ../shared/traces/conversation_trace.jsonl \
        --profile llama2-70b-a100-tp8-2023 --speed 3 --ttft-slo 30 --policy kvcache_centric \
        --admission predictive --ttft-after-transfer --json out/bands.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from config.errors import KvgateError
from replay.report.report import summarize, write_json
from replay.report.results import Outcome, RequestOutcome, RunResult
from replay.sim import sim_cli

# Bands of prompt-length rank (fractions of the trace's requests, shortest first).
BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 0.99), (0.99, 1.0))


def band_shares(
    requests: Sequence[RequestOutcome], ttft_slo_s: float, tbt_slo_s: float
) -> list[dict[str, Any]]:
    """Per band of prompt-length rank: its token range, admitted share and SLO-met share."""
    order = sorted(requests, key=lambda o: (o.prompt_tokens, o.request_id))
    n = len(order)
    rows = []
    for lo, hi in BANDS:
        band = order[int(lo * n) : int(hi * n)]
        if not band:
            continue
        admitted = sum(o.outcome is not Outcome.REJECTED for o in band)
        met = sum(o.meets_slo(ttft_slo_s, tbt_slo_s) for o in band)
        rows.append(
            {
                "rank": f"{lo:.2f}-{hi:.2f}",
                "tokens": [band[0].prompt_tokens, band[-1].prompt_tokens],
                "requests": len(band),
                "admitted": round(admitted / len(band), 4),
                "slo_met": round(met / len(band), 4),
            }
        )
    return rows


def run(args: argparse.Namespace, spec: sim_cli.RunSpec, reservation: str) -> RunResult:
    args = argparse.Namespace(**{**vars(args), "decode_reservation": reservation})
    settings = sim_cli.base_settings(args)
    fleet = sim_cli.fleet_from(args, settings)
    trace = sim_cli.load_workload(args)
    return sim_cli.run_one(settings, fleet, trace, spec, True, sim_cli.sim_options(args))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.admission_bands", description=__doc__)
    sim_cli.add_arguments(p)
    args = p.parse_args(argv)
    try:
        (spec,) = sim_cli.parse_run_specs(
            f"{args.policy or 'kvcache_centric'}+{args.admission or 'predictive'}", None
        )
    except (ValueError, KvgateError) as exc:
        p.error(str(exc))
    runs: list[dict[str, Any]] = []
    for switch in ("off", "on"):
        result = run(args, spec, switch)
        summary = summarize(result)  # carries reserve_turned_away from the run
        summary["label"] += f" reservation {switch}"
        # Judged against the SLOs the run used (flags, else the config's).
        summary["bands"] = band_shares(result.requests, result.ttft_slo_s, result.tbt_slo_s)
        runs.append(summary)
    off, on = runs
    print(f"goodput r/s: reservation off {off['goodput_rps']:.3f}, on {on['goodput_rps']:.3f}")
    print(f"{'band':>10} {'tokens':>17} {'admitted off':>13} {'on':>7} {'met off':>8} {'on':>7}")
    for a, b in zip(off["bands"], on["bands"], strict=True):
        tokens = f"{a['tokens'][0]}-{a['tokens'][1]}"
        print(
            f"{a['rank']:>10} {tokens:>17} {a['admitted']:>13.1%} {b['admitted']:>7.1%}"
            f" {a['slo_met']:>8.1%} {b['slo_met']:>7.1%}"
        )
    if args.json:
        write_json(args.json, runs, extra={"trace": args.trace, "speed": args.speed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
