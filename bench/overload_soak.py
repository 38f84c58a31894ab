"""Overload and soak benchmarks of the live gateway on an emulated fleet (issue 12, item 3).

Engine emulators and one ``kvgate serve`` run as child processes on 127.0.0.1
(``bench.emulated_fleet``); open-loop Poisson load (``bench.phase_load``) drives
the gateway at rates relative to the fleet's capacity ``1x``: given (``--rate-1x``), or probed
(the highest rate on a short geometric ladder where admission ``early`` serves >= 95 % of all
requests within the SLOs).

* ``overload``: 1x for ``--minutes``, then 3x for ``--minutes``. Goodput (requests/s within
  the SLOs) of each phase and their ratio (target >= 0.9), how fast rejections are answered as
  the client sees them (p50/p99; target p99 <= 5 ms, judged on the probe below when it runs),
  gateway RSS over time, books at the end.
* ``--reject-probe``: alongside either mode, one sequential client in a child process
  (``bench.rejection_path --live``) sends ~4k-token prompts with ``x-slo-ttft-ms: 1`` every
  ``--probe-every-ms``; all are rejected, so it adds no engine work, and its latencies (per
  phase, split by the hopeless and the full path) isolate the rejection path from the load
  client's own event loop.
* ``soak``: 1x for ``--minutes``. Gateway RSS every ``--sample-s`` seconds and its growth after
  the warm-up (target <= 5 %): the first 20 % and until the gateway's slowest bounded
  structures are full (decision history, the learner's refit window; ``--refit-window``
  sets the latter's size; if they never fill, the growth after the 20 % is judged, their
  filling included); KV index size and decision history over time (bounded), books at the
  end (back to zero).

    python -m bench.overload_soak overload --minutes 5 --json out/overload.json
    python -m bench.overload_soak soak --minutes 30 --rate-1x 4 --json out/soak.json

The defaults (1 prefill + 1 decode emulated llama3-8b H100 engines at real speed, ~4k-token
prompts, 64 output tokens, TTFT SLO 1 s) keep the rates low (1x is ~4 req/s), so the client,
the gateway and the engines fit on a small shared machine.

Every loop is bounded in count and time; every child process is ended by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.emulated_fleet import EmulatedFleet, FleetSpec
from bench.kvgate_serve import end_children_on_sigterm
from bench.overload_report import (
    Phase,
    books_bounds,
    format_report,
    kv_index_flat,
    phase_summary,
    rss_growth,
    series,
)
from bench.phase_load import drive

OVERLOAD_FACTOR = 3.0


# ---------------------------------------------------------------- capacity
async def probe_capacity(
    fleet: EmulatedFleet, args: argparse.Namespace, **load: Any
) -> tuple[float, list]:
    """The highest rate of a geometric ladder (``--probe-start`` x 1.5^k, at most
    ``--probe-steps`` rungs of ``--probe-s`` seconds) served >= 95 % within the SLOs; ``load``
    goes to ``drive`` (how prompts are encoded, the model)."""
    best, ladder = 0.0, []
    rate = args.probe_start
    for _ in range(args.probe_steps):
        run = await drive(fleet, [Phase(f"probe {rate:g}", rate, args.probe_s)], args, **load)
        s = phase_summary(run, 0, args)
        ladder.append({k: s[k] for k in ("rate_rps", "slo_attainment", "goodput_rps", "rejected")})
        await asyncio.to_thread(fleet.settled_books)  # the next load starts on an idle fleet
        if not (s["slo_attainment"] or 0) >= 0.95:
            break
        best, rate = rate, round(rate * 1.5, 2)
    if best == 0.0:
        raise RuntimeError(f"no probed rate met the SLOs: {ladder}")
    return best, ladder


# ---------------------------------------------------------------- modes
async def run_mode(fleet: EmulatedFleet, args: argparse.Namespace) -> dict[str, Any]:
    rate, ladder = (args.rate_1x, None) if args.rate_1x else await probe_capacity(fleet, args)
    seconds = args.seconds if args.seconds else 60.0 * args.minutes
    if args.mode == "overload":
        phases = [Phase("1x", rate, seconds), Phase("3x", OVERLOAD_FACTOR * rate, seconds)]
    else:
        phases = [Phase("1x", rate, seconds)]
    probe = args.probe_every_ms if args.reject_probe else None
    run = await drive(fleet, phases, args, sample_s=args.sample_s, probe_every_ms=probe)
    books_end = (await asyncio.to_thread(fleet.settled_books)).as_dict()
    summaries = [phase_summary(run, k, args) for k in range(len(phases))]
    total_s = sum(p.duration_s for p in phases)
    out: dict[str, Any] = {
        "mode": args.mode,
        "rate_1x_rps": rate,
        "rate_source": "probe" if ladder else "configured",
        "probe": ladder,
        "phases": summaries,
        "samples": series(run),
        "rss_growth": rss_growth(run, total_s, fleet.spec.recent_decisions),
        "books_over_time": books_bounds(run),
        "books_end": books_end,
        "recent_decisions_bound": fleet.spec.recent_decisions,
        "gateway_tracebacks": fleet.log_tracebacks(),
        "client_cut_short": run.cut_short,
    }
    targets: dict[str, Any] = {}
    if args.mode == "overload":
        g1, g3 = summaries[0]["goodput_rps"], summaries[1]["goodput_rps"]
        ratio = round(g3 / g1, 3) if g1 and g3 is not None else None
        # How fast the gateway answers a rejection: the probe's view when it ran (a client of
        # its own, idle between sends), else the load client's, whose event loop, busy with
        # 3x of streams, adds its own delay to what it measures.
        probe = summaries[1].get("reject_probe_ms")
        p99 = probe["all"]["p99"] if probe else summaries[1]["reject_ms"]["p99"]
        out["goodput_ratio_3x_1x"] = ratio
        out["reject_p99_ms"] = {"value": p99, "source": "probe" if probe else "load client"}
        targets["goodput_ratio_ge_0.9"] = ratio is not None and ratio >= 0.9
        targets["reject_p99_le_5ms"] = p99 is not None and p99 <= 5.0
    else:
        rss = out["rss_growth"]
        growth = rss["growth_pct"]
        # Structures never full: the growth after the 20 % includes their filling, so it is
        # an upper bound on the growth after the warm-up, and the target is judged on it.
        targets["rss_growth_le_5pct"] = growth is not None and growth <= 5.0
        bounds = out["books_over_time"]
        targets["decision_history_bounded"] = (
            bounds.get("decision_history_max", 10**9) <= fleet.spec.recent_decisions
        )
        targets["kv_index_bounded"] = kv_index_flat(run, total_s)
    targets["books_at_zero"] = books_end["requests_in_flight"] == 0 and (
        books_end["history_in_flight"] == 0
    )
    out["targets_met"] = targets
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overload_soak", description=__doc__)
    p.add_argument("mode", choices=["overload", "soak"])
    p.add_argument("--minutes", type=float, default=None, help="per phase (5 / 30 by default)")
    p.add_argument("--seconds", type=float, default=None, help="per phase; overrides --minutes")
    p.add_argument("--rate-1x", type=float, default=None, help="capacity; default: probed")
    p.add_argument("--probe-start", type=float, default=2.0)
    p.add_argument("--probe-steps", type=int, default=6)
    p.add_argument("--probe-s", type=float, default=20.0)
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--profile", default="llama3-8b-h100-tp1")
    p.add_argument("--input-tokens", type=int, default=4096, help="mean prompt length")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--sample-s", type=float, default=10.0, help="RSS and books sampling period")
    p.add_argument("--base-port", type=int, default=18500)
    p.add_argument("--workdir", default=None, help="config and logs (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    probe = "also run a sequential client of rejected 4k-token requests (x-slo-ttft-ms: 1)"
    p.add_argument("--reject-probe", action="store_true", help=probe)
    p.add_argument("--probe-every-ms", type=float, default=100.0, help="its send period")
    refits = "the gateway's prefill refits (default: 0 = none for overload, 60 for soak)"
    p.add_argument("--refit-interval-s", type=float, default=None, help=refits)
    p.add_argument("--refit-window", type=int, default=None, help="server.refit_window")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments (argparse exits 2 with a message on bad ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.minutes is None:
        args.minutes = 5.0 if args.mode == "overload" else 30.0
    if args.refit_interval_s is None:
        args.refit_interval_s = 0.0 if args.mode == "overload" else 60.0
    given = [args.minutes, args.sample_s, args.probe_s, args.probe_start]
    if min(given + ([args.seconds] if args.seconds is not None else [])) <= 0:
        parser.error("durations must be > 0")
    if args.rate_1x is not None and args.rate_1x <= 0:
        parser.error("--rate-1x must be > 0")
    return args


def fleet_spec(args: argparse.Namespace, workdir: Path) -> FleetSpec:
    return FleetSpec(
        workdir=workdir,
        base_port=args.base_port,
        prefill=args.prefill,
        decode=args.decode,
        profile=args.profile,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        refit_interval_s=args.refit_interval_s,
        refit_window=args.refit_window,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end_children_on_sigterm()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix=f"kvgate-{args.mode}-"))
    with EmulatedFleet(fleet_spec(args, workdir)) as fleet:
        rep = asyncio.run(run_mode(fleet, args))
    rep["args"] = vars(args)
    print(format_report(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
