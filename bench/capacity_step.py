"""Capacity gauge under a load step: live replay at 1x then 2x, compared with the simulator.

Live: engine emulators (2 prefill + 2 decode, in real time) and a gateway on loopback
(``gateway.stack``), the bundled trace slice replayed open-loop: its first ``--phase`` seconds
at speed 1, then the next ``2 * --phase`` seconds at speed 2 (the arrival rate doubles at
t = phase). Every scrape interval the gateway's /metrics is read, as Prometheus would, and
``kvgate_pool_instances_needed`` / ``kvgate_pool_load_instances`` recorded per pool. The
report says when the gauge moved after the step and what it settled at.

Simulated: for each phase's requests on their own, the smallest prefill count (decode pool
large) and the smallest decode count (prefill pool large) for which ``replay.sim.simulator`` meets
the SLOs (SLO attainment >= ``--attainment``) — the instance counts the gauge is compared with.

    python -m bench.capacity_step --phase 60 --json /tmp/capacity/step.json

Bounded: the live part lasts 2 * phase seconds plus the drain of the last requests (each
request times out after 120 s); the search tries at most ``--max-instances`` per pool.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from config.settings import AdmissionMode, Settings
from gateway.demo import bundled_trace
from gateway.stack import LiveStack, StackSpec
from replay.live.loadgen import LoadOptions, run_load
from replay.report.report import summarize
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import SimOptions, Simulator
from replay.workload.traces import TraceRequest, load_trace
from routing.capacity import DemandWindow

GAUGES = ("kvgate_pool_instances_needed", "kvgate_pool_load_instances", "kvgate_pool_instances")


def step_trace(base: list[TraceRequest], phase_s: float) -> list[TraceRequest]:
    """[0, phase) at speed 1, then [phase, 3 phase) of the trace at speed 2 from t = phase."""
    out = [r for r in base if r.arrival_s < phase_s]
    out += [
        replace(r, arrival_s=phase_s + (r.arrival_s - phase_s) / 2)
        for r in base
        if phase_s <= r.arrival_s < 3 * phase_s
    ]
    return out


def settings_for(args: argparse.Namespace) -> Settings:
    base = Settings()
    return replace(
        base,
        slo=replace(base.slo, ttft_s=args.ttft_slo, tbt_s=args.tbt_slo),
        admission=replace(base.admission, mode=AdmissionMode(args.admission)),
        server=replace(base.server, scrape_interval_s=args.scrape_interval, refit_interval_s=0),
    )


async def _sample(stack: LiveStack, interval: float, t0: float, stop: asyncio.Event) -> list[dict]:
    """The gauges as Prometheus reads them, plus the terms behind them (in process)."""
    url = stack.url
    samples: list[dict] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            at = time.perf_counter() - t0
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            row: dict[str, Any] = {"t_s": round(at, 3)}
            for fam in text_string_to_metric_families(text):
                for s in fam.samples:
                    if s.name in GAUGES:
                        row[f"{s.name.removeprefix('kvgate_pool_')}:{s.labels['pool']}"] = s.value
            for pool, need in stack.gateway.capacity.last.items():
                row[f"prefill_s_per_s:{pool}"] = round(need.prefill_load_s_per_s, 4)
                row[f"utilisation_target:{pool}"] = round(need.prefill_utilisation_target, 4)
                row[f"decode_tokens_per_s:{pool}"] = round(need.decode_tokens_per_s, 1)
                row[f"decode_batch_limit:{pool}"] = need.decode_batch_limit
            samples.append(row)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
    return samples


async def _watch(stack: LiveStack, t0: float, stop: asyncio.Event) -> list[dict]:
    """When the gateway recomputed the gauges (its own round), read in process every 20 ms:
    the change is timed by the gateway's round, not by when a scraper happens to look."""
    updates: list[dict] = []
    last = None
    while not stop.is_set():
        now = stack.gateway.capacity.last
        if now is not last and now:
            last = now
            row: dict[str, Any] = {"t_s": round(time.perf_counter() - t0, 3)}
            row.update({f"load_instances:{p}": n.load_instances for p, n in now.items()})
            updates.append(row)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.02)
    return updates


async def live(args: argparse.Namespace, trace: list[TraceRequest]) -> dict[str, Any]:
    settings = settings_for(args)
    stack = LiveStack(
        StackSpec(
            prefill=args.prefill, decode=args.decode, profile=args.profile, time_scale=1.0,
            base=settings,
        )
    )  # fmt: skip
    await stack.start()
    try:
        stack.gateway.capacity.window = DemandWindow(args.window)
        opts = LoadOptions(
            stack.url, 1.0, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo, timeout_s=120.0
        )
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample(stack, args.scrape_interval, t0, stop))
        watcher = asyncio.create_task(_watch(stack, t0, stop))
        result = await run_load(trace, opts)
        stop.set()
        samples = await sampler
        updates = await watcher
    finally:
        await stack.stop()
    phases = [
        [r for r in result.requests if r.arrival_s < args.phase],
        [r for r in result.requests if r.arrival_s >= args.phase],
    ]
    report = []
    for reqs in phases:
        run = replace(result, requests=reqs, load=[], tbt_steps=[])
        run.duration_s = args.phase
        s = summarize(run)
        report.append({k: s[k] for k in ("requests", "rejected", "slo_attainment", "ttft_p90_s")})
    arrivals = sorted(r.arrival_s for r in result.requests)
    return {"samples": samples, "updates": updates, "phases": report, "arrivals": arrivals}


def _moved(updates: list[dict], key: str, phase_s: float, cmp) -> float | None:
    before = [u for u in updates if u["t_s"] < phase_s and key in u]
    if not before:
        return None
    hit = next(
        (u for u in updates if u["t_s"] >= phase_s and key in u and cmp(u[key], before[-1][key])),
        None,
    )
    return round(hit["t_s"] - phase_s, 3) if hit is not None else None


def tracking(
    updates: list[dict], arrivals: list[float], pool: str, window_s: float
) -> dict[str, Any]:
    """How closely the gauge follows the demand actually sent, and with what delay: the
    correlation of the gateway's rounds with the count of requests sent in the window
    ``(t - lag - W, t - lag]``, for lags of 0 to 5 s. A best lag of 0 means the gauge follows
    the demand at the next round; the trace's bursts make this a sharper test than the step."""
    key = f"load_instances:{pool}"
    rows = [u for u in updates if key in u and u["t_s"] >= window_s]
    if len(rows) < 3:
        return {"pool": pool, "error": "not enough rounds"}
    gauge = [u[key] for u in rows]

    def sent(lo: float, hi: float) -> int:
        return bisect.bisect_right(arrivals, hi) - bisect.bisect_right(arrivals, lo)

    corr = {}
    for k in range(0, 21):
        lag = k * 0.25
        ref = [sent(u["t_s"] - lag - window_s, u["t_s"] - lag) for u in rows]
        flat = len(set(ref)) < 2 or len(set(gauge)) < 2
        corr[lag] = 0.0 if flat else round(statistics.correlation(gauge, ref), 3)
    best = max(corr, key=lambda lag: corr[lag])
    return {
        "pool": pool,
        "best_lag_s": best,
        "corr_at_best": corr[best],
        "corr_lag_0": corr[0.0],
        "corr_lag_1s": corr[1.0],
        "corr_lag_5s": corr[5.0],
    }


def _medians(rows: list[dict], pool: str) -> dict[str, float]:
    keys = ("prefill_s_per_s", "utilisation_target", "decode_tokens_per_s", "decode_batch_limit")
    return {
        k: round(statistics.median(r[f"{k}:{pool}"] for r in rows), 3)
        for k in keys
        if all(f"{k}:{pool}" in r for r in rows)
    }


def step_response(
    samples: list[dict], pool: str, phase_s: float, window_s: float, updates: list[dict]
) -> dict:
    """Levels before and after the step (from the scrapes), and how long after it the gauge
    moved (from the gateway's rounds, ``updates``) and reached its new level (scrapes)."""
    need, load = f"instances_needed:{pool}", f"load_instances:{pool}"
    steady1 = [s for s in samples if window_s <= s["t_s"] < phase_s and need in s]
    steady2 = [s for s in samples if phase_s + window_s <= s["t_s"] < 2 * phase_s and need in s]
    after = [s for s in samples if s["t_s"] >= phase_s and need in s]
    before = [s for s in samples if s["t_s"] < phase_s and need in s]
    if not steady1 or not steady2 or not after or not before:
        return {"pool": pool, "error": "not enough samples"}
    lvl1 = statistics.median(s[load] for s in steady1)
    lvl2 = statistics.median(s[load] for s in steady2)
    n1 = statistics.median(s[need] for s in steady1)
    n2 = statistics.median(s[need] for s in steady2)
    top1 = max(s[load] for s in steady1)

    def first(pred) -> float | None:
        hit = next((s for s in after if pred(s)), None)
        return round(hit["t_s"] - phase_s, 3) if hit is not None else None

    return {
        "pool": pool,
        "load_before": round(lvl1, 3),
        "load_after": round(lvl2, 3),
        "needed_before": n1,
        "needed_after": n2,
        "needed_before_max": max(s[need] for s in steady1),
        "needed_after_max": max(s[need] for s in steady2),
        "terms_before": _medians(steady1, pool),
        "terms_after": _medians(steady2, pool),
        # the gateway's first round after the step, and the first above the last one before it
        "first_round_after_s": _moved(updates, load, phase_s, lambda a, b: True),
        "moved_after_s": _moved(updates, load, phase_s, lambda a, b: a > b),
        "above_phase1_max_after_s": first(lambda s: s[load] > top1),
        "reached_90pct_after_s": first(lambda s: s[load] >= lvl1 + 0.9 * (lvl2 - lvl1)),
        "reached_needed_after_s": first(lambda s: s[need] >= n2),
    }


def simulate(args: argparse.Namespace, trace: list[TraceRequest], prefill: int, decode: int):
    settings = settings_for(args)
    settings = replace(settings, routing=replace(settings.routing, block_size=512))
    fleet = FleetSpec(
        prefill=prefill, decode=decode, profile=args.profile, decode_local_check=False
    )
    sim = Simulator(settings, fleet, trace, SimOptions(label="sim", ttft_after_transfer=True))
    return summarize(sim.run())


def smallest(args: argparse.Namespace, trace: list[TraceRequest], pool: str) -> dict[str, Any]:
    """The smallest count of ``pool`` that meets the SLOs, the other pool at the maximum.

    Some requests miss the TTFT SLO on any fleet (a prompt whose prefill alone is longer), so
    "meets" is relative to the largest fleet tried: SLO attainment at least ``--attainment``
    times the attainment of ``--max-instances`` of both (the gauge's 5 % miss share is also
    counted over the requests that can make it)."""
    best = simulate(args, trace, args.max_instances, args.max_instances)["slo_attainment"]
    tried = []
    for n in range(1, args.max_instances + 1):
        p, d = (n, args.max_instances) if pool == "prefill" else (args.max_instances, n)
        got = simulate(args, trace, p, d)["slo_attainment"]
        tried.append({"n": n, "slo_attainment": round(got, 4)})
        if got >= args.attainment * best:
            return {"needed": n, "best_attainment": round(best, 4), "tried": tried}
    return {"needed": None, "best_attainment": round(best, 4), "tried": tried}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.capacity_step", description=__doc__)
    p.add_argument("--phase", type=float, default=60.0, help="wall seconds per phase")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--profile", default="llama3-8b-h100-tp1")
    p.add_argument("--admission", default="predictive")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--window", type=float, default=10.0, help="capacity demand window (s)")
    p.add_argument(
        "--attainment", type=float, default=0.95, help="share of the best SLO attainment to meet"
    )
    p.add_argument("--max-instances", type=int, default=8)
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    if args.phase <= 0 or args.phase > 600:
        p.error("--phase must be in (0, 600]")
    base = load_trace(bundled_trace())
    trace = step_trace(base, args.phase)
    load_start = os.getloadavg()  # a busy machine delays the gateway's rounds: say so
    t_start = time.perf_counter()
    live_part = asyncio.run(live(args, trace))
    live_wall = time.perf_counter() - t_start
    load_end = os.getloadavg()
    phase_traces = {
        "1x": [r for r in base if r.arrival_s < args.phase],
        "2x": [
            replace(r, arrival_s=(r.arrival_s - args.phase) / 2)
            for r in base
            if args.phase <= r.arrival_s < 3 * args.phase
        ],
    }
    sim = {
        name: {pool: smallest(args, tr, pool) for pool in ("prefill", "decode")}
        for name, tr in phase_traces.items()
    }
    steps = [
        step_response(live_part["samples"], pool, args.phase, args.window, live_part["updates"])
        for pool in ("prefill", "decode")
    ]
    tracks = [
        tracking(live_part["updates"], live_part["arrivals"], pool, args.window)
        for pool in ("prefill", "decode")
    ]
    comparison = [
        {
            "pool": s["pool"],
            "gauge_1x": s.get("needed_before"),
            "sim_1x": sim["1x"][s["pool"]]["needed"],
            "gauge_2x": s.get("needed_after"),
            "sim_2x": sim["2x"][s["pool"]]["needed"],
        }
        for s in steps
    ]
    report = {
        "args": vars(args),
        "live_wall_s": round(live_wall, 1),
        "loadavg_1m_start_end": [round(load_start[0], 2), round(load_end[0], 2)],
        "cpus": os.cpu_count(),
        "live_phases": live_part["phases"],
        "step_response": steps,
        "tracking": tracks,
        "comparison": comparison,
        "simulator": sim,
        "samples": live_part["samples"],
        "updates": live_part["updates"],
    }
    print(
        json.dumps({k: v for k, v in report.items() if k not in ("samples", "updates")}, indent=2)
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
