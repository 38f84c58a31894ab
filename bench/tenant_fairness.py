"""Two tenants on an emulated fleet: does one tenant's burst hurt the other? (issue 12, item 4)

Tenants ``a`` and ``b`` (equal weights, API keys) share ``kvgate emulate`` engines behind one
``kvgate serve`` (``bench.emulated_fleet``, child processes on 127.0.0.1). Open-loop Poisson
load at rates relative to the fleet's capacity ``1x`` (``--rate-1x``, docs/reliability.md):

1. ``alone``: tenant b alone at its share (``--share`` x 1x) for ``--seconds``;
2. ``burst``: b as before while tenant a bursts at ``--burst`` times its share.

Per gateway configuration (``--fairness on``, ``off`` or ``both``: a fresh fleet each) it
reports b's SLO attainment (completed within the TTFT and TBT SLOs / sent) in both phases and
the difference in points (target <= 5), b's rejections, a's goodput, and the books at the end.

    python -m bench.tenant_fairness --seconds 60 --json out/tenant_fairness.json

The defaults (1 prefill + 1 decode emulated llama3-70b A100 TP4 engines at real speed, ~2k-token
prompts, 32 output tokens, TTFT SLO 2 s, 1x = 2.5 req/s) keep the request rates low so that
the client, the gateway and the engines fit on a small shared machine.

Every loop is bounded in count and time; every child process is ended by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from bench.emulated_fleet import EmulatedFleet, FleetSpec
from bench.kvgate_serve import end_children_on_sigterm
from bench.overload_report import Phase, PhaseRun, phase_summary
from bench.phase_load import DRAIN_S, finish_or_cancel, phase_trace, send_at
from config.tenant_keys import hash_key
from replay.live.loadgen import LoadOptions, prompt_ids, send_one
from replay.report.results import Outcome, RequestOutcome
from replay.workload.traces import TraceRequest

KEYS = {"a": "sk-bench-tenant-a", "b": "sk-bench-tenant-b"}
A_HASH_OFFSET = 10**7  # a's prompts never share a prefix with b's


class TenantFleet(EmulatedFleet):
    """The emulated fleet with two tenants (keys required) and fair sharing on or off."""

    def __init__(self, spec: FleetSpec, fair_share: bool, headroom: float) -> None:
        super().__init__(spec)
        self.fair_share = fair_share
        self.headroom = headroom

    def _config(self, urls: dict[str, str]) -> str:
        lines = [
            "[tenants]",
            "enabled = true",
            f"fair_share = {'true' if self.fair_share else 'false'}",
            f"over_share_headroom = {self.headroom}",
        ]
        for name, key in KEYS.items():
            lines += ["[[tenants.tenant]]", f'name = "{name}"', f'key_sha256 = ["{hash_key(key)}"]']
        return super()._config(urls) + "\n".join(lines) + "\n"

    def tenants(self) -> dict[str, Any]:
        """GET /admin/tenants (blocking: call it from a thread inside an event loop)."""
        return self.admin("/admin/tenants")


def tenant_trace(
    rate: float, seconds: float, args: argparse.Namespace, seed: int, offset: int
) -> list[TraceRequest]:
    trace = phase_trace([Phase("p", rate, seconds)], args.input_tokens, args.output_tokens, seed)
    return [replace(tr, hash_ids=tuple(h + offset for h in tr.hash_ids)) for _, tr in trace]


async def drive(fleet: EmulatedFleet, loads: dict[str, list[TraceRequest]], args) -> PhaseRun:
    """Open-loop load of both tenants at once, each with its own key; one PhaseRun per tenant
    (phase index = tenant order in ``loads``)."""
    names = list(loads)
    opts = LoadOptions(
        fleet.url,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        timeout_s=max(60.0, 10 * args.ttft_slo),
    )
    merged = sorted(
        ((tr.arrival_s, k, tr) for k, name in enumerate(names) for tr in loads[name]),
        key=lambda x: (x[0], x[1]),
    )
    run = PhaseRun(
        [Phase(n, len(loads[n]) / args.seconds, args.seconds) for n in names],
        [[] for _ in names],
        [[] for _ in names],
    )
    tasks: set[asyncio.Task[None]] = set()
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            headers={"Authorization": f"Bearer {KEYS[n]}"},
        )
        for n in names
    ]
    try:
        t0 = time.perf_counter()
        for arrival, k, tr in merged:
            if not await send_at(arrival, t0, tasks, run):
                break
            out = RequestOutcome(
                f"{names[k]}{tr.index}", arrival, tr.input_length, tr.output_length
            )
            run.outcomes[k].append(out)
            coro = _send(sessions[k], tr, opts, t0, out, run.reject_ms[k])
            task = asyncio.create_task(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await finish_or_cancel(tasks, DRAIN_S + opts.timeout_s)
    finally:
        for s in sessions:
            await s.close()
    return run


async def _send(session, tr, opts, t0, out: RequestOutcome, reject_ms: list[float]) -> None:
    sent = time.perf_counter()
    # A distinct request id per tenant: send_one names requests by their trace index.
    tr = replace(tr, index=tr.index + (A_HASH_OFFSET if out.request_id.startswith("a") else 0))
    await send_one(session, tr, prompt_ids(tr, {}), opts, t0, out)
    if out.outcome is Outcome.REJECTED:
        reject_ms.append((time.perf_counter() - sent) * 1e3)


def _tenant_summary(run: PhaseRun, k: int, args: argparse.Namespace) -> dict[str, Any]:
    s = phase_summary(run, k, args)
    keep = ("requests", "completed", "rejected", "failed", "slo_met", "slo_attainment")
    out = {key: s[key] for key in keep}
    out.update(
        rate_rps=round(s["rate_rps"], 2),
        goodput_rps=s["goodput_rps"],
        ttft_p99_s=s["ttft_p99_s"],
        tbt_p99_s=s["tbt_p99_s"],
        rejections_by_reason=s["rejections_by_reason"],
    )
    return out


async def run_config(fleet: TenantFleet, args: argparse.Namespace) -> dict[str, Any]:
    share_rps = args.share * args.rate_1x
    b_load = tenant_trace(share_rps, args.seconds, args, args.seed, 0)
    load = [os.getloadavg()[0]]
    alone = await drive(fleet, {"b": b_load}, args)
    load.append(os.getloadavg()[0])
    await asyncio.to_thread(fleet.settled_books)
    await asyncio.sleep(args.gap_s)  # b's activity and recent work fade before the burst
    b_load2 = tenant_trace(share_rps, args.seconds, args, args.seed + 1, 2 * A_HASH_OFFSET)
    a_load = tenant_trace(args.burst * share_rps, args.seconds, args, args.seed + 2, A_HASH_OFFSET)
    load.append(os.getloadavg()[0])
    burst = await drive(fleet, {"b": b_load2, "a": a_load}, args)
    load.append(os.getloadavg()[0])
    books = (await asyncio.to_thread(fleet.settled_books)).as_dict()
    tenants = await asyncio.to_thread(fleet.tenants)
    b_alone = _tenant_summary(alone, 0, args)
    b_burst = _tenant_summary(burst, 0, args)
    att0, att1 = b_alone["slo_attainment"] or 0.0, b_burst["slo_attainment"] or 0.0
    drop = round(100 * (att0 - att1), 2)
    return {
        "fair_share": fleet.fair_share,
        "b_alone": b_alone,
        "b_with_a_burst": b_burst,
        "a_burst": _tenant_summary(burst, 1, args),
        "b_attainment_drop_points": drop,
        "target_drop_le_5_points": drop <= 5.0,
        "books_end": books,
        "tenants_end": tenants,  # GET /admin/tenants: outcomes, over-share rejections
        "gateway_tracebacks": fleet.log_tracebacks(),
        # 1-minute load average before and after each phase: a shared machine's stalls
        # show up as TTFT the engines never predicted.
        "load_1m": [round(v, 2) for v in load],
        "client_cut_short": alone.cut_short or burst.cut_short,
    }


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"1x = {rep['args']['rate_1x']} req/s; b at {rep['args']['share']} x 1x, "
        f"a bursting at {rep['args']['burst']} x its share; {rep['args']['seconds']} s per phase"
    ]
    lines.append(
        f"{'fairness':9} {'b alone':>8} {'b burst':>8} {'drop pts':>9} {'b rej':>6} "
        f"{'a good/s':>9} {'a rej':>6}"
    )
    for r in rep["runs"]:
        lines.append(
            f"{'on' if r['fair_share'] else 'off':9} {r['b_alone']['slo_attainment'] or 0:8.3f} "
            f"{r['b_with_a_burst']['slo_attainment'] or 0:8.3f} "
            f"{r['b_attainment_drop_points']:9.2f} {r['b_with_a_burst']['rejected']:6d} "
            f"{r['a_burst']['goodput_rps'] or 0:9.2f} {r['a_burst']['rejected']:6d}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tenant_fairness", description=__doc__)
    p.add_argument("--fairness", choices=["on", "off", "both"], default="both")
    p.add_argument("--seconds", type=float, default=60.0, help="per phase")
    p.add_argument("--rate-1x", type=float, default=2.5, help="the fleet's capacity, req/s")
    p.add_argument("--share", type=float, default=0.5, help="each tenant's share of 1x")
    p.add_argument("--burst", type=float, default=5.0, help="a's rate / its share")
    p.add_argument("--headroom", type=float, default=0.5, help="tenants.over_share_headroom")
    p.add_argument("--gap-s", type=float, default=12.0, help="pause between the phases")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--profile", default="llama3-70b-a100-tp4")
    p.add_argument("--input-tokens", type=int, default=2048, help="mean prompt length")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--admission", choices=["early", "predictive"], default="early")
    p.add_argument("--base-port", type=int, default=18950)
    p.add_argument("--workdir", default=None, help="configs and logs (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.seconds, args.rate_1x, args.share, args.burst) <= 0 or args.gap_s < 0:
        parser.error("durations, rates and factors must be > 0")
    if not 0 <= args.headroom < 1:
        parser.error("--headroom must be in [0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end_children_on_sigterm()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvgate-tenants-"))
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.fairness]
    runs = []
    for fair in modes:
        spec = FleetSpec(
            workdir=workdir / ("fair" if fair else "unfair"),
            base_port=args.base_port,
            prefill=args.prefill,
            decode=args.decode,
            profile=args.profile,
            admission=args.admission,
            ttft_slo_s=args.ttft_slo,
            tbt_slo_s=args.tbt_slo,
        )
        with TenantFleet(spec, fair, args.headroom) as fleet:
            runs.append(asyncio.run(run_config(fleet, args)))
    rep = {"args": vars(args), "runs": runs}
    print(format_report(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
