"""Several kvgate replicas in front of one emulated fleet, with and without the replica exchange.

The same live replay (the bundled slice by default) through 1, 2 and 4 ``kvgate serve``
replicas, the client load split round-robin over them (request i goes to replica i mod N).
Each run starts a fresh fleet of ``kvgate emulate`` processes (KV events on, so every replica
sees the engines' cache) so no run inherits another's cache. With the exchange every replica
publishes its dispatched-but-unfinished work over ZMQ and counts the others' (docs/replicas.md);
without it each replica sees only its own share of the load; with ``--interval-only`` a run
whose replicas publish on the interval only (the exchange before publishing on dispatch) joins
each round. Reports goodput and mean TTFT relative to the round's one-replica run, a diagnosis
per run (rejections by reason, prefill split, predicted against observed TTFT, same-instance
pairs across replicas) and the client's send lag (a stalled box shows there first);
``--json`` writes everything and ``<logs>/<run>-outcomes.jsonl`` every request's outcome.
Every process started here is ended by PID; ports come from 20000-20899 (the tests take
20900-20999).

    python -m bench.replicas --duration 180 --json /tmp/replicas/bench.json
    python -m bench.replicas --replicas 1,2,4 --no-baseline-off --interval-only --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.kvgate_serve import KVGATE_MAIN, end_children_on_sigterm, wait_healthy
from gateway.demo import bundled_trace
from replay.live.loadgen import LoadOptions, prompt_ids, send_one
from replay.report.report import summarize
from replay.report.results import Outcome, RequestOutcome, RunResult
from replay.workload.traces import TraceRequest, load_trace, select

KEYS = ("goodput_rps", "ttft_mean_s", "ttft_p90_s", "rejected", "cache_hit_ratio")
HERD_WINDOW_S = 0.1  # two admissions this close, by different replicas: could they herd?


def send_lag(outcomes: list[RequestOutcome], trace: list[TraceRequest]) -> float:
    """The client's worst delay in sending a request past its trace time (s)."""
    lags = [o.arrival_s - tr.arrival_s for o, tr in zip(outcomes, trace, strict=True)]
    return max(lags, default=0.0)


def diagnose(outcomes: list[RequestOutcome], replicas: int) -> dict:
    """Where a replica's TTFT comes from: rejections by reason, the prefill instances' split,
    predicted against observed TTFT, and herding (two requests admitted within
    ``HERD_WINDOW_S`` by different replicas placed on the same prefill instance, against the
    same for pairs from one replica, which sees its own previous choice at once)."""
    reasons: dict[str, int] = {}
    split: dict[str, int] = {}
    for o in outcomes:
        if o.outcome is Outcome.REJECTED:
            reasons[o.reason] = reasons.get(o.reason, 0) + 1
        if o.prefill_instance:
            split[o.prefill_instance] = split.get(o.prefill_instance, 0) + 1
    done = [
        (k, o)
        for k, o in enumerate(outcomes)
        if o.outcome is Outcome.COMPLETED and o.ttft_s is not None and o.prefill_instance
    ]
    pred = [o.predicted_ttft_s for _, o in done if o.predicted_ttft_s is not None]
    obs = [o.ttft_s for _, o in done if o.predicted_ttft_s is not None]
    pairs = {"cross": [0, 0], "own": [0, 0]}  # [same instance, pairs]
    ordered = sorted(done, key=lambda ko: ko[1].arrival_s)
    for (k1, a), (k2, b) in itertools.pairwise(ordered):
        if b.arrival_s - a.arrival_s <= HERD_WINDOW_S:
            kind = "own" if k1 % replicas == k2 % replicas else "cross"
            pairs[kind][0] += a.prefill_instance == b.prefill_instance
            pairs[kind][1] += 1
    per_replica = [[o.ttft_s for k, o in done if k % replicas == r] for r in range(replicas)]
    return {
        "rejected_by_reason": reasons,
        "prefill_split": dict(sorted(split.items())),
        "predicted_ttft_mean_s": round(sum(pred) / len(pred), 4) if pred else None,
        "observed_ttft_mean_s": round(sum(obs) / len(obs), 4) if obs else None,
        "same_instance_pairs": {k: f"{v[0]}/{v[1]}" for k, v in pairs.items()},
        "ttft_mean_by_replica_s": [round(sum(t) / len(t), 4) if t else None for t in per_replica],
    }


_GIVEN: set[int] = set()


def _port() -> int:
    """A free loopback port in 20000-20899, never the same one twice in a run."""
    for port in range(20000, 20900):
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError("no free port left in 20000-20899")


def _kvgate(log: Path, *args: str) -> subprocess.Popen:
    out = log.open("w")
    return subprocess.Popen([sys.executable, "-c", KVGATE_MAIN, *args], stdout=out, stderr=out)


class StartError(RuntimeError):
    """A process did not come up (its port can be taken between the probe and its bind by
    another process)."""


async def _wait(url: str, proc: subprocess.Popen) -> None:
    try:
        await asyncio.to_thread(wait_healthy, f"{url}/health", proc, 60.0, url)
    except (RuntimeError, TimeoutError) as exc:
        raise StartError(str(exc)) from None


def _config(
    args: argparse.Namespace,
    engines: dict,
    port: int,
    replica: str,
    ex: dict,
    on_dispatch: bool = True,
) -> str:
    lines = [
        "[slo]",
        f"ttft_s = {args.ttft_slo}",
        f"tbt_s = {args.tbt_slo}",
        "[routing]",
        f'policy = "{args.policy}"',
        "block_size = 16",
        "[admission]",
        f'mode = "{args.admission}"',
        "[predictors]",
        f'profile = "{args.profile}"',
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "refit_interval_s = 0",
    ]
    if ex:
        peers = ", ".join(f'"{p}"' for p in ex["peers"])
        lines += [
            "[replicas]",
            "enabled = true",
            f'replica_id = "{replica}"',
            f'bind = "{ex["bind"]}"',
            f"peers = [{peers}]",
            f"publish_interval_s = {args.publish_interval}",
            f"publish_on_dispatch = {'true' if on_dispatch else 'false'}",
            f"rotate_ties = {'false' if args.no_rotate_ties else 'true'}",
        ]
    for role in ("prefill", "decode"):
        lines += ["[[pools]]", f'name = "{role}"', f'role = "{role}"']
        for iid, (url, events) in engines.items():
            if iid.startswith(role[0]):
                lines += [
                    "[[pools.instances]]",
                    f'id = "{iid}"',
                    f'url = "{url}"',
                    f'kv_events_endpoint = "{events}"',
                    "kv_events_bind = false",
                ]
    return "\n".join(lines) + "\n"


async def _load(trace: list[TraceRequest], targets: list[str], args) -> RunResult:
    """Open-loop replay, request i to targets[i % N] (a round-robin load balancer)."""
    opts = [
        LoadOptions(t, args.time_scale, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo)
        for t in targets
    ]
    result = RunResult(
        label="live",
        policy="live",
        admission="live",
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        duration_s=(trace[-1].arrival_s - trace[0].arrival_s) if trace else 0.0,
    )
    outcomes = [
        RequestOutcome(f"replay-{tr.index}", tr.arrival_s, tr.input_length, tr.output_length)
        for tr in trace
    ]
    cache: dict[int, list[int]] = {}
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for k, (tr, out) in enumerate(zip(trace, outcomes, strict=True)):
            ids = prompt_ids(tr, cache)
            delay = tr.arrival_s * args.time_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            o = opts[k % len(opts)]
            tasks.append(asyncio.create_task(send_one(session, tr, ids, o, start, out)))
        await asyncio.gather(*tasks)
    result.requests = outcomes
    result.wall_s = time.perf_counter() - start
    return result


async def run_one(
    args,
    trace,
    replicas: int,
    exchange: bool,
    logs: Path,
    on_dispatch: bool = True,
    rnd: int = 0,
) -> dict:
    procs: list[subprocess.Popen] = []
    exchange = exchange and replicas > 1
    mode = ("ex" if on_dispatch else "ex-interval") if exchange else "noex"
    tag = f"{replicas}r-{mode}-{rnd}"
    try:
        engines: dict[str, tuple[str, str]] = {}
        for role, n in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(n):
                port, events = _port(), _port()
                iid = f"{role[0]}{i}"
                procs.append(
                    _kvgate(
                        logs / f"{tag}-{iid}.log",
                        "emulate",
                        "--role",
                        role,
                        "--protocol",
                        "vllm",
                        "--profile",
                        args.profile,
                        "--port",
                        str(port),
                        "--time-scale",
                        str(args.time_scale),
                        "--kv-events-port",
                        str(events),
                    )
                )
                engines[iid] = (f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events}")
        for (url, _), proc in zip(engines.values(), procs, strict=True):
            await _wait(url, proc)
        ports = [_port() for _ in range(replicas)]
        binds = [f"tcp://127.0.0.1:{_port()}" for _ in range(replicas)]
        for r in range(replicas):
            ex = {}
            if exchange:
                ex = {"bind": binds[r], "peers": [b for b in binds if b != binds[r]]}
            cfg = logs / f"{tag}-gw{r}.toml"
            # on_dispatch False: the exchange publishes only every interval, for a
            # comparison inside one run of this benchmark.
            cfg.write_text(_config(args, engines, ports[r], f"r{r}", ex, on_dispatch))
            procs.append(
                _kvgate(
                    logs / f"{tag}-gw{r}.log",
                    "serve",
                    "--config",
                    str(cfg),
                    "--log-level",
                    "warning",
                )
            )
        targets = [f"http://127.0.0.1:{p}" for p in ports]
        for t, proc in zip(targets, procs[len(engines) :], strict=True):
            await _wait(t, proc)
        await asyncio.sleep(1.0)  # KV-event subscriptions and peer connections settle
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        result = await asyncio.wait_for(_load(trace, targets, args), args.max_run_s)
        summary = summarize(result)
        with (logs / f"{tag}-outcomes.jsonl").open("w") as f:
            for o in result.requests:
                f.write(json.dumps(dataclasses.asdict(o)) + "\n")
        return {
            "replicas": replicas,
            "exchange": exchange,
            "on_dispatch": exchange and on_dispatch,
            "wall_s": round(time.monotonic() - t0, 1),
            # The box's 1-minute load average before and after: other work on a small box
            # slows the emulators' step loops, which shows as TTFT (compare runs with care).
            "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)],
            **{k: summary[k] for k in KEYS},
            "requests": summary.get("requests", len(trace)),
            # The client's worst delay in sending a request (s, trace time): over ~0.5 s the
            # box stalled every process, the load generator included, and the run's TTFT
            # measures the box rather than the routing.
            "send_lag_max_s": round(send_lag(result.requests, trace), 3),
            "diagnosis": diagnose(result.requests, replicas),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__)
    p.add_argument("--trace", help="trace (default: the bundled 10-minute slice)")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of trace")
    p.add_argument("--speed", type=float, default=1.0, help="load factor")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    p.add_argument("--no-baseline-off", action="store_true", help="skip runs without exchange")
    p.add_argument(
        "--interval-only",
        action="store_true",
        help="also run each replica count with snapshots on the interval only (no publish on "
        "dispatch: the exchange before it)",
    )
    p.add_argument(
        "--no-rotate-ties",
        action="store_true",
        help="replicas break placement ties in registration order, all alike (before 2026-11-27)",
    )
    p.add_argument("--rounds", type=int, default=1, help="run every configuration this often")
    p.add_argument("--profile", default="llama3-8b-h100-tp1")
    p.add_argument("--policy", default="kvcache_centric")
    p.add_argument("--admission", default="predictive")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--publish-interval", type=float, default=0.05)
    p.add_argument("--max-run-s", type=float, default=900.0, help="bound on one run's load")
    p.add_argument("--logs", help="folder for configs and process logs (default: a temp dir)")
    p.add_argument("--json", help="write the runs and ratios here")
    args = p.parse_args(argv)
    end_children_on_sigterm()  # a killed run still ends the processes it started
    counts = sorted({int(x) for x in args.replicas.split(",")})
    if not counts or min(counts) < 1 or max(counts) > 16:
        p.error("--replicas: counts between 1 and 16")
    trace = select(
        load_trace(args.trace or bundled_trace()), duration_s=args.duration, speed=args.speed
    )
    logs = Path(args.logs or tempfile.mkdtemp(prefix="kvgate-replicas-"))
    logs.mkdir(parents=True, exist_ok=True)
    # One round: every configuration once, interleaved, so the box's load at the time
    # falls on all of them; each round's ratios are against its own one-replica run.
    plan = [(n, True, True) for n in counts]
    plan += [(n, True, False) for n in counts if n > 1 and args.interval_only]
    plan += [(n, False, False) for n in counts if n > 1 and not args.no_baseline_off]
    runs = []
    for rnd in range(args.rounds):
        for n, ex, on_dispatch in plan:
            for attempt in range(3):  # a port lost to another process: start the run again
                try:
                    run = asyncio.run(run_one(args, trace, n, ex, logs, on_dispatch, rnd))
                    break
                except StartError as exc:
                    print(f"run {n} replicas: {exc}; attempt {attempt + 2}/3", file=sys.stderr)
            else:
                raise SystemExit(f"run with {n} replicas did not start")
            run["round"] = rnd
            runs.append(run)
            print(json.dumps(run), flush=True)
    for r in runs:
        base = next((b for b in runs if b["replicas"] == 1 and b["round"] == r["round"]), None)
        if base is not None:
            r["vs_1"] = {
                k: round(r[k] / base[k], 4) if base[k] else None
                for k in ("goodput_rps", "ttft_mean_s")
            }
    print(
        f"{'round':>5} {'replicas':>8} {'exchange':>12} {'goodput r/s':>11} {'TTFT mean s':>11} "
        f"{'goodput/1':>9} {'TTFT/1':>7} {'rejected':>8} {'send lag s':>10}"
    )
    for r in runs:
        v = r.get("vs_1", {})
        mode = ("dispatch" if r["on_dispatch"] else "interval") if r["exchange"] else "off"
        print(
            f"{r['round']:>5} {r['replicas']:>8} {mode:>12} {r['goodput_rps']:>11.3f} "
            f"{r['ttft_mean_s']:>11.3f} {v.get('goodput_rps')!s:>9} "
            f"{v.get('ttft_mean_s')!s:>7} {r['rejected']:>8} {r['send_lag_max_s']:>10.2f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
