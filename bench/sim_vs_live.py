"""Sim-vs-live agreement: the same trace slice replayed live and simulated.

Live: engine emulators (`kvgate emulate`, one process each) and the gateway (`kvgate serve`),
all on 127.0.0.1, driven open-loop by the load generator. Simulated: `replay.sim.simulator` on the
same fleet, profile, policy, admission and SLOs, with TTFT measured when the KV reaches decode
(as the emulators stream it). Prints both reports and the live/sim ratios; `--json` writes
them. Every process started here is ended by PID.

    python -m bench.sim_vs_live --duration 600 --time-scale 1.0 --json out/agreement.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import aiohttp

from config.settings import AdmissionMode, AdmissionSettings, PredictorSettings, Settings
from gateway.demo import bundled_trace
from replay.live.loadgen import LoadOptions, run_load
from replay.report.progress import ProgressBar
from replay.report.report import format_table, summarize
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import SimOptions, Simulator
from replay.workload.traces import load_trace, select

KEYS = (
    "ttft_mean_s",
    "ttft_p90_s",
    "goodput_rps",
    "rejected",
    "rejected_after_prefill",
    "cache_hit_ratio",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kvgate(*args: str) -> subprocess.Popen:
    code = "import sys; from gateway.cli import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def _wait(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def _config(path: Path, args: argparse.Namespace, urls: dict[str, str], port: int) -> None:
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
    for role in ("prefill", "decode"):
        lines += ["[[pools]]", f'name = "{role}"', f'role = "{role}"']
        for iid, url in urls.items():
            if iid.startswith(role[0]):
                lines += ["[[pools.instances]]", f'id = "{iid}"', f'url = "{url}"']
    path.write_text("\n".join(lines) + "\n")


async def live(args: argparse.Namespace, trace) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        urls = {}
        for role, n in (("prefill", args.prefill), ("decode", args.decode)):
            for i in range(n):
                port = _port()
                procs.append(
                    _kvgate(
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
                    )
                )
                urls[f"{role[0]}{i}"] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            await _wait(url)
        gw_port = _port()
        cfg = Path(tempfile.mkdtemp(prefix="kvgate-agree-")) / "gateway.toml"
        _config(cfg, args, urls, gw_port)
        procs.append(_kvgate("serve", "--config", str(cfg), "--log-level", "warning"))
        gw_url = f"http://127.0.0.1:{gw_port}"
        await _wait(gw_url)
        opts = LoadOptions(
            gw_url, args.time_scale, label="live", ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo
        )
        result = await run_load(trace, opts, ProgressBar("live", enabled=not args.quiet))
        return summarize(result)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def simulate(args: argparse.Namespace, trace) -> dict:
    settings = Settings(
        predictors=PredictorSettings(profile=args.profile),
        admission=AdmissionSettings(mode=AdmissionMode(args.admission)),
    )
    settings = replace(
        settings,
        slo=replace(settings.slo, ttft_s=args.ttft_slo, tbt_s=args.tbt_slo),
        routing=replace(settings.routing, policy=args.policy, block_size=512),
    )
    fleet = FleetSpec(
        prefill=args.prefill, decode=args.decode, profile=args.profile, decode_local_check=False
    )
    sim = Simulator(settings, fleet, trace, SimOptions(label="sim", ttft_after_transfer=True))
    return summarize(sim.run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim_vs_live", description=__doc__)
    p.add_argument("--trace", help="trace (default: the bundled 10-minute slice)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of trace")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--profile", default="llama3-8b-h100-tp1")
    p.add_argument("--policy", default="kvcache_centric")
    p.add_argument("--admission", default="predictive")
    p.add_argument("--ttft-slo", type=float, default=2.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--json", help="write both reports and the ratios here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    trace = select(load_trace(args.trace or bundled_trace()), duration_s=args.duration)
    sim = simulate(args, trace)
    live_report = asyncio.run(live(args, trace))
    print(format_table([sim, live_report]))
    ratios = {k: (live_report[k] / sim[k]) if sim.get(k) else None for k in KEYS}
    for k in KEYS:
        print(
            f"{k:24s} sim {sim[k]!s:>22} live {live_report[k]!s:>22} "
            f"live/sim {ratios[k] if ratios[k] is None else round(ratios[k], 3)}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {"sim": sim, "live": live_report, "ratios": ratios, "args": vars(args)}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
