"""Proxy benchmark: kvgate against sglang-router and vllm-router, alternating with direct runs.

4 stub engines (bench/stub_engine.py) on 127.0.0.1; kvgate (colocated pool, kvcache_centric,
predictive admission) and the Rust routers in front of them; wrk (one thread, keep-alive
connections) sends chat completions: 256 distinct ~1 KB prompts with a shared system prompt,
16 output tokens. Modes: ns (non-streaming), s (streaming, 16 tokens in a burst), sd
(streaming paced at 1 ms per token; the stubs are restarted with --delay-ms 1).

For every round, mode and concurrency the order is direct, T1, direct, T2, ..., direct; each
target run is compared with the mean of the direct runs on either side (direct = wrk against
one stub). CPU per request is utime+stime of the target's whole process tree over the run,
divided by the requests wrk completed. Added TTFT at c=1 comes from a keep-alive streaming
client (median over sequential requests, paced stubs). Results: JSON (--out) and markdown
tables on stdout. Every process started here is ended by its PID.

    python -m bench.proxy --out out/proxy-bench.json            # full run, ~25 min
    python -m bench.proxy --quick --out /tmp/proxy-quick.json   # smoke: c=1,16, 2 s runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from bench import proxy_load as load
from bench import proxy_targets as tg
from bench.proxy_report import MODES, aggregate, aggregate_ttft, summarize, tables


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.proxy",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Targets: " + ", ".join(tg.ALL_TARGETS),
    )
    p.add_argument("--out", default="out/proxy-bench.json", help="JSON result file")
    p.add_argument("--targets", nargs="+", default=list(tg.ALL_TARGETS), choices=tg.ALL_TARGETS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--conc", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    p.add_argument("--rounds", type=int, default=2, help="results are medians over rounds")
    p.add_argument("--warmup", type=int, default=1, help="seconds of warm-up per target/phase")
    p.add_argument("--tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--ttft-n", type=int, default=30, help="sequential requests per TTFT probe")
    p.add_argument("--workdir", default="/tmp/kvgate-bench", help="router venvs, logs, lua")
    p.add_argument("--base-port", type=int, default=18000)
    p.add_argument("--no-install", action="store_true", help="do not pip-install the routers")
    p.add_argument("--max-total-s", type=float, default=3600, help="stop starting new runs after")
    p.add_argument("--quick", action="store_true", help="smoke test: c=1,16, 2 s, 1 round")
    unique = "a new user turn for every request (default: 256 bodies cycled)"
    p.add_argument("--unique", action="store_true", help=unique)
    p.add_argument(
        "--model-dir",
        default=str(tg.default_model_dir() or "") or None,
        help="model directory for the kvgate-exact target (default: engines/vllm_cpu.sh's "
        "tiny model, when installed)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.conc, args.duration, args.rounds, args.ttft_n = [1, 16], 2, 1, 15
    return args


def machine_info() -> dict:
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.wrk = load.ensure_wrk()
        self.lua = load.write_lua(Path(tempfile.mkdtemp(prefix="lua-", dir=workdir)))
        self.versions: dict[str, str | None] = {"kvgate": _kvgate_version()}
        self.unavailable: dict[str, str] = {}
        self.stubs: list[tg.Proc] = []
        self.targets: dict[str, tg.Proc] = {}
        self.raw: list[dict] = []
        self.ttft_raw: list[dict] = []
        self.rss: dict[str, float] = {}
        self.deadline = time.monotonic() + args.max_total_s
        self.truncated = False
        self._runs = 0  # wrk runs with --unique so far

    def install(self) -> None:
        if "kvgate-exact" in self.args.targets and self.args.model_dir is None:
            self.unavailable["kvgate-exact"] = "no --model-dir (run engines/vllm_cpu.sh install)"
        routers = [t for t in self.args.targets if t in tg.ROUTER_TARGETS]
        for venv in {tg.ROUTER_TARGETS[t][0] for t in routers}:
            version, error = tg.ensure_router(self.workdir, venv, not self.args.no_install)
            self.versions[tg.ROUTERS[venv][1]] = version
            if error:
                for t, (v, _) in tg.ROUTER_TARGETS.items():
                    if v == venv and t in self.args.targets:
                        self.unavailable[t] = error

    # ------------------------------------------------------------ processes
    def start(self, delay_ms: float) -> None:
        base = self.args.base_port
        self.stubs = [tg.stub_proc(self.workdir, base + 1 + i, delay_ms) for i in range(4)]
        for s in self.stubs:
            s.start()
        for s in self.stubs:
            if not tg.wait_ready(s, 20):
                raise RuntimeError(f"stub {s.name} did not start: {s.error}")
        urls = [s.url for s in self.stubs]
        ports = {"kvgate": base + 100, "kvgate-exact": base + 101}
        ports |= {"sglang-rr": base + 110, "sglang-ca": base + 111}
        ports |= {"vllm-rr": base + 120, "vllm-ca": base + 121}
        for name in self.args.targets:
            if name in self.unavailable:
                continue
            if name in tg.KVGATE_TARGETS:
                exact = name == "kvgate-exact" and self.args.model_dir
                model_dir = Path(self.args.model_dir) if exact else None
                proc = tg.kvgate_proc(self.workdir, urls, ports[name], name, model_dir)
            else:
                proc = tg.router_proc(self.workdir, name, urls, ports[name])
            proc.start()
            self.targets[name] = proc
        for name, proc in list(self.targets.items()):
            if not tg.wait_ready(proc, 60):
                self.unavailable[name] = f"failed to start: {proc.error}"
                proc.stop()
                del self.targets[name]

    def stop(self) -> None:
        for proc in [*self.targets.values(), *self.stubs]:
            self.rss.setdefault(proc.name, round(tg.rss_mb(proc.refresh_pids()), 1))
            proc.stop()
        self.targets, self.stubs = {}, []

    # ------------------------------------------------------------ runs
    def one(self, name: str, mode: str, c: int, duration: int, rnd: int | None) -> dict:
        proc = self.targets.get(name)
        url = (proc.url if proc else self.stubs[0].url) + load.CHAT_PATH
        pids = proc.refresh_pids() if proc else []
        stub_pids = [s.refresh_pids() for s in self.stubs]
        cpu0 = tg.cpu_seconds(pids)
        stub0 = [tg.cpu_seconds(sp) for sp in stub_pids]
        busy0, ru0, t0 = tg.machine_busy_seconds(), _children_cpu(), time.monotonic()
        unique_from = None
        if self.args.unique:  # every run its own numbers: no turn repeats across runs
            self._runs += 1
            unique_from = self._runs * 10_000_000
        stream, tokens = MODES[mode][0], self.args.tokens
        res = load.run_wrk(self.wrk, self.lua, url, c, duration, stream, tokens, unique_from)
        wall = time.monotonic() - t0
        cpu = tg.cpu_seconds(pids) - cpu0
        per_stub = [tg.cpu_seconds(sp) - c0 for sp, c0 in zip(stub_pids, stub0, strict=True)]
        stub_cpu = sum(per_stub)
        n = res["requests"] or 1
        res.update(target=name, mode=mode, c=c, round=rnd)
        res["cpu_us_per_req"] = round(cpu / n * 1e6, 1) if proc else None
        res["stub_cpu_us_per_req"] = round(stub_cpu / n * 1e6, 1)
        # How the target spread the load: the busiest engine's share of all engine CPU
        # (0.25 = even over 4). Engines that share a 2-core box with the load generator cost
        # less in total when one of them takes everything (fewer, fuller event-loop passes).
        res["busiest_stub_share"] = round(max(per_stub) / stub_cpu, 2) if stub_cpu > 0 else None
        res["wrk_cpu_us_per_req"] = round((_children_cpu() - ru0) / n * 1e6, 1)
        res["machine_busy_cores"] = round((tg.machine_busy_seconds() - busy0) / wall, 2)
        if rnd is not None:
            self.raw.append(res)
        return res

    def phase(self, modes: list[str], rounds: int) -> None:
        a = self.args
        names = [t for t in a.targets if t in self.targets]
        for mode in modes:
            for name in ["direct", *names]:  # warm-up, not recorded
                self.one(name, mode, max(a.conc), a.warmup, None)
        for rnd in range(rounds):
            order = names[rnd % len(names) :] + names[: rnd % len(names)] if names else []
            for mode in modes:
                for c in a.conc:
                    if time.monotonic() > self.deadline:
                        self.truncated = True
                        return
                    self.one("direct", mode, c, a.duration, rnd)
                    for name in order:
                        r = self.one(name, mode, c, a.duration, rnd)
                        self.one("direct", mode, c, a.duration, rnd)
                        print(
                            f"  r{rnd} {mode:2} c={c:<3} {name:10} {r['rps']:8.0f} req/s "
                            f"p50 {r['p50_ms'] or 0:7.2f} ms  cpu {r['cpu_us_per_req']} us/req",
                            file=sys.stderr,
                            flush=True,
                        )

    def ttft(self, rounds: int) -> None:
        names = [t for t in self.args.targets if t in self.targets]
        for rnd in range(rounds):
            for name in ["direct", *names]:
                proc = self.targets.get(name)
                url = proc.url if proc else self.stubs[0].url
                res = load.measure_ttft(url, self.args.ttft_n, self.args.tokens)
                self.ttft_raw.append({"target": name, "round": rnd, **res})


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _kvgate_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("kvgate")
    except Exception:  # not installed: running from a checkout
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    bench = Bench(args, workdir)
    bench.install()
    t0 = time.monotonic()
    phases = [
        (0.0, [m for m in args.modes if m != "sd"]),
        (1.0, [m for m in args.modes if m == "sd"]),
    ]
    try:
        for delay, modes in phases:
            if not modes and delay == 0.0:
                continue
            print(f"phase: stubs --delay-ms {delay}, modes {modes}", file=sys.stderr, flush=True)
            bench.start(delay)
            if modes:
                bench.phase(modes, args.rounds)
            if delay:  # TTFT with paced stubs
                bench.ttft(args.rounds)
            bench.stop()
    finally:
        bench.stop()
    machine["loadavg_end"] = os.getloadavg()
    runs = aggregate(bench.raw)
    ttft = aggregate_ttft(bench.ttft_raw)
    result = {
        "machine": machine,
        "versions": bench.versions,
        "unavailable": bench.unavailable,
        "params": {k: v for k, v in vars(args).items()},
        "elapsed_s": round(time.monotonic() - t0, 1),
        "truncated": bench.truncated,
        "rss_mb_after": bench.rss,
        "runs": runs,
        "ttft": ttft,
        "summary": summarize(runs, ttft, args.conc),
        "raw": bench.raw,
        "ttft_raw": bench.ttft_raw,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(tables(result))
    print(f"\nwritten: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
