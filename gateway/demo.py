"""`kvgate demo`: a whole fleet on loopback for about a minute, then a report.

Starts engine emulators (2 prefill + 2 decode by default) and a gateway, replays a slice of the
bundled trace (the first 10 minutes of the Mooncake conversation trace, shipped in
``replay/workload/data``) through the gateway with a progress bar, prints the report, writes
plots and JSON, and shuts everything down. Emulators run time-scaled (``--time-scale``), so
model time passes faster than wall time; reported latencies are in model time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

from config.settings import AdmissionMode, PDProtocol, ReplicationSink, Settings
from gateway.runtime import Gateway
from gateway.stack import LiveStack, StackSpec
from replay.live.loadgen import LoadOptions, run_load
from replay.report.progress import ProgressBar
from replay.workload.traces import load_trace, select

BUNDLED = "conversation_10min.jsonl"


def bundled_trace() -> Path:
    return Path(str(files("replay.workload") / "data" / BUNDLED))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help="trace to replay (default: the bundled 10-minute slice)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--colocated", type=int, default=0, help="N colocated instances instead")
    p.add_argument("--protocol", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--profile", default="llama3-8b-h100-tp1")
    p.add_argument("--policy", default="kvcache_centric")
    p.add_argument("--admission", choices=[m.value for m in AdmissionMode], default="predictive")
    p.add_argument(
        "--duration", type=float, default=240.0, help="seconds of trace to replay (default 240)"
    )
    p.add_argument("--speed", type=float, default=1.0, help="load factor")
    p.add_argument(
        "--time-scale",
        type=float,
        default=0.25,
        help="wall seconds per model second (default 0.25: 4x faster than real)",
    )
    p.add_argument(
        "--replication-sink",
        choices=[m.value for m in ReplicationSink],
        default="engine",
        help="where hot-prefix copies go (default: the engines pull from each other)",
    )
    p.add_argument("--out", default="kvgate-demo", help="directory for plots and JSON")
    p.add_argument("--quiet", action="store_true")


async def _run(args: argparse.Namespace) -> int:
    from replay.report.plots import write_plots
    from replay.report.report import format_table, summarize, write_json

    trace = select(
        load_trace(args.trace or bundled_trace()), duration_s=args.duration, speed=args.speed
    )
    base = Settings()
    base = replace(
        base,
        routing=replace(base.routing, policy=args.policy),
        admission=replace(base.admission, mode=AdmissionMode(args.admission)),
        replication=replace(base.replication, sink=ReplicationSink(args.replication_sink)),
    )
    spec = StackSpec(
        prefill=0 if args.colocated else args.prefill,
        decode=0 if args.colocated else args.decode,
        colocated=args.colocated,
        protocol=PDProtocol(args.protocol),
        profile=args.profile,
        time_scale=args.time_scale,
        base=base,
    )
    stack = LiveStack(spec)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))
    await stack.start()
    try:
        say(
            f"kvgate demo: gateway {stack.url}, {len(stack.emulators)} emulators "
            f"({args.protocol}, {args.profile}), replaying {len(trace)} requests "
            f"({args.duration:.0f} s of trace at time scale {args.time_scale})"
        )
        opts = LoadOptions(
            stack.url,
            args.time_scale,
            label=f"{args.policy}+{args.admission}",
            ttft_slo_s=base.slo.ttft_s,
            tbt_slo_s=base.slo.tbt_s,
        )
        result = await run_load(trace, opts, ProgressBar("live replay", enabled=not args.quiet))
        gw = stack.gateway
        result.replication_commands = gw.conductor.planner.issued
        result.extra["gateway_decisions"] = gw.conductor.stats.decisions
        accuracy = gw.learner.accuracy()
        result.extra["ttft_prediction_mape_pct"] = accuracy["ttft_mape_pct"] or ""
        replication = _replication_summary(gw)
        result.extra.update(replication)
    finally:
        await stack.stop()
    summary = summarize(result)
    print(format_table([summary]))
    print(
        f"replication ({args.replication_sink} sink): {replication['replication_issued']} issued,"
        f" {replication['replication_confirmed']} confirmed;"
        f" {replication['replicated_prefixes_on_2plus']} replicated prefixes now cached on"
        " 2 or more prefill instances"
    )
    out = Path(args.out)
    write_json(out / "report.json", [summary], extra={"trace": str(args.trace or BUNDLED)})
    paths = write_plots([result], out)
    say(f"wrote {out / 'report.json'} and {len(paths)} plots in {out}/")
    return 0


def _replication_summary(gw: Gateway) -> dict[str, int]:
    """Commands issued/confirmed, and how many copied prefixes the cache view now shows on
    more than one prefill instance (the hot prefix spreading)."""
    confirmed = [r for r in gw.replicator.log if r.state == "confirmed"]
    prefill = [iid for iid, inst in gw.conductor.instances.items() if inst.does_prefill]
    keys = {r.prefix_key for r in confirmed}
    spread = sum(1 for k in keys if sum(gw.conductor.index.holds(iid, k) for iid in prefill) >= 2)
    return {
        "replication_issued": gw.conductor.planner.issued,
        "replication_confirmed": len(confirmed),
        "replicated_prefixes_on_2plus": spread,
    }


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130
