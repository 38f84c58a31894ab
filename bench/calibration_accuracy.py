"""Predicted vs observed TTFT through kvgate in front of a live engine, per predictor profile.

For each variant, a `kvgate serve` subprocess fronts the engine (one instance, admission off)
and a mixed workload goes through it one request at a time (no queueing: the prediction is
the prefill time): cold prompts and partly cached ones (a prefix sent first, itself a cold
request, then prefix + extension) of log-uniform lengths. Each request's predicted TTFT is the
gateway's ``x-kvgate-predicted-ttft-ms`` header; the observed TTFT is the client's time to the
first streamed token chunk. Prompts are token-id lists (exact counts on vLLM and llama.cpp),
fresh random ids per request (system entropy) so no variant or earlier run hits
the cache.

Variants: ``profile`` (predictors.profile_file = --profile, no refits), ``profile-refit`` (the
same, online refits continuing from the profile's sweep), ``default`` (the built-in profile, no
refits) and ``default-refit`` (the built-in profile with refits). Refits run every 5 s from 10
new observations; every variant's error is also reported over the second half of the run.

    python -m bench.calibration_accuracy --engine http://127.0.0.1:8080 --kind llamacpp \\
        --model tiny --profile llama.json --requests 60 > accuracy.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.kvgate_serve import end_children_on_sigterm, free_port, kvgate_serve

VARIANTS = ("profile", "profile-refit", "default", "default-refit")
ADMIN_TOKEN = "calibration-bench"  # loopback only, for /admin/predictors (refit count)


@dataclass(frozen=True)
class Case:
    length: int
    cached_fraction: float  # 0 = cold


@dataclass
class Observation:
    kind: str  # "cold" | "cached"
    prompt_tokens: int
    cached_tokens: int | None  # as the engine reported it (None: not reported)
    predicted_ms: float
    observed_ms: float

    @property
    def error(self) -> float:
        return abs(self.predicted_ms - self.observed_ms) / self.observed_ms


def make_cases(count: int, min_tokens: int, max_tokens: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        length = round(min_tokens * (max_tokens / min_tokens) ** rng.random())
        fraction = 0.0 if rng.random() < 0.5 else rng.choice((0.3, 0.5, 0.7, 0.9))
        cases.append(Case(length, fraction))
    return cases


def gateway_config(args: argparse.Namespace, variant: str, port: int) -> str:
    protocol = "vllm" if args.kind == "vllm" else "openai"
    refit = (
        "refit_interval_s = 5\nrefit_min_new_samples = 10\n"
        if variant.endswith("-refit")
        else "refit_interval_s = 0\n"
    )
    predictors = (
        f'profile_file = "{Path(args.profile).resolve()}"\n'
        if variant.startswith("profile")
        else ""
    )
    return (
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nhealth_interval_s = 5\n'
        f"scrape_interval_s = {args.scrape_interval_s}\n"
        f'admin_token = "{ADMIN_TOKEN}"\n{refit}'
        f"[routing]\nblock_size = {args.block_size}\n"
        f'[admission]\nmode = "none"\n[replication]\nenabled = false\n'
        f"[predictors]\n{predictors}"
        f'[[pools]]\nname = "engines"\nrole = "both"\n'
        f'[[pools.instances]]\nid = "e0"\nurl = "{args.engine}"\nprotocol = "{protocol}"\n'
    )


async def _ttft(
    session: aiohttp.ClientSession, url: str, model: str, tokens: list[int]
) -> tuple[float, float, int | None]:
    """(predicted ms, observed ms, engine-reported cached tokens)."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    t0 = time.perf_counter()
    first: float | None = None
    cached: int | None = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        predicted = float(resp.headers["x-kvgate-predicted-ttft-ms"])
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
                continue
            chunk = json.loads(line[5:])
            choices = chunk.get("choices") or []
            if first is None and choices and choices[0].get("text") is not None:
                first = (time.perf_counter() - t0) * 1000
            usage = chunk.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details.get("cached_tokens"), int):
                cached = details["cached_tokens"]
    if first is None:
        raise RuntimeError("no token chunk")
    return predicted, first, cached


async def drive(url: str, args: argparse.Namespace, cases: list[Case]):
    rng = random.Random()  # fresh ids every run: an engine keeps earlier runs' prompts cached
    out: list[Observation] = []
    errors = 0

    def cold(n: int) -> list[int]:
        return [rng.randrange(10, args.vocab_size) for _ in range(n)]

    deadline = time.monotonic() + args.budget_s
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for case in cases:
            if time.monotonic() > deadline:
                break
            try:
                prefix_len = int(case.length * case.cached_fraction)
                if prefix_len == 0:
                    tokens = cold(case.length)
                    p, o, c = await _ttft(session, url, args.model, tokens)
                    out.append(Observation("cold", len(tokens), c, p, o))
                    continue
                prefix = cold(prefix_len)
                p, o, c = await _ttft(session, url, args.model, prefix)
                out.append(Observation("cold", len(prefix), c, p, o))
                tokens = prefix + cold(case.length - prefix_len)
                p, o, c = await _ttft(session, url, args.model, tokens)
                out.append(Observation("cached", len(tokens), c, p, o))
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
                errors += 1
                print(f"calibration_accuracy: {type(exc).__name__}: {exc}", file=sys.stderr)
    return out, errors


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(100 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def summarise(obs: list[Observation]) -> dict[str, Any]:
    def block(rows: list[Observation]) -> dict[str, Any]:
        errs = [r.error for r in rows]
        return {
            "n": len(rows),
            "abs_err_p50_pct": _pct(errs, 0.5),
            "abs_err_p90_pct": _pct(errs, 0.9),
            "mean_signed_err_pct": round(
                100
                * statistics.fmean((r.predicted_ms - r.observed_ms) / r.observed_ms for r in rows),
                1,
            )
            if rows
            else None,
            "observed_ms_p50": round(statistics.median(r.observed_ms for r in rows), 1)
            if rows
            else None,
            "predicted_ms_p50": round(statistics.median(r.predicted_ms for r in rows), 1)
            if rows
            else None,
        }

    half = len(obs) // 2
    return {
        "all": block(obs),
        "cold": block([r for r in obs if r.kind == "cold"]),
        "cached": block([r for r in obs if r.kind == "cached"]),
        "second_half": block(obs[half:]),
    }


def run_variant(args: argparse.Namespace, variant: str, cases: list[Case], tmp: Path):
    port = args.port or free_port()
    cfg = tmp / f"{variant}.toml"
    cfg.write_text(gateway_config(args, variant, port))
    with kvgate_serve(cfg, port, tmp / f"{variant}.log") as url:
        t0 = time.perf_counter()
        obs, errors = asyncio.run(drive(url, args, cases))
        req = urllib.request.Request(
            f"{url}/admin/predictors", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            learner = json.loads(resp.read()) if resp.status == 200 else {}
    return {
        "variant": variant,
        "requests": len(obs),
        "errors": errors,
        "wall_s": round(time.perf_counter() - t0, 1),
        "refits": learner.get("refits"),
        **summarise(obs),
        "samples": [
            [
                r.kind,
                r.prompt_tokens,
                r.cached_tokens,
                round(r.predicted_ms, 1),
                round(r.observed_ms, 1),
            ]
            for r in obs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine base URL")
    p.add_argument("--kind", choices=("vllm", "llamacpp", "emulator"), default="vllm")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--profile", help="profile file from `kvgate profile` (variant 'profile')")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--requests", type=int, default=40, help="workload cases per variant")
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument(
        "--block-size", type=int, default=16, help="routing.block_size (vLLM's: 32 here)"
    )
    p.add_argument("--budget-s", type=float, default=240.0, help="per variant")
    p.add_argument(
        "--scrape-interval-s",
        type=float,
        default=1.0,
        help="server.scrape_interval_s: how often kvgate reads the engine's /metrics",
    )
    p.add_argument("--port", type=int, default=0, help="gateway port (0 = a free one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    end_children_on_sigterm()  # a killed run still ends the processes it started
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or (any(v.startswith("profile") for v in variants) and not args.profile):
        p.error(f"unknown variants {sorted(unknown)}" if unknown else "--profile is required")
    cases = make_cases(args.requests, args.min_tokens, args.max_tokens, args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvgate-calib-") as tmp:
        for variant in variants:
            print(f"calibration_accuracy: variant {variant}", file=sys.stderr)
            results.append(run_variant(args, variant, cases, Path(tmp)))
    out = {
        "engine": args.engine,
        "kind": args.kind,
        "profile": args.profile,
        "cases": len(cases),
        "results": results,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
