"""LoRA affinity on an emulated fleet whose engines run one adapter at a time.

``python -m bench.lora_affinity --json F`` starts colocated emulators serving the same LoRA
adapters with vLLM's default ``--max-loras 1`` (a request for another adapter waits until the
running adapter's requests have left, as on a real vLLM: tests/real/test_lora_routing.py) and
one gateway in front, in one process on loopback, and sends the same bounded closed-loop
workload with ``routing.lora_affinity`` on and off, in alternating rounds: each request names
one adapter (Zipf over the adapters), a unique prompt (no prefix to share, so the cache does
not steer placement) and a random answer length. It reports each run's TTFT (mean, p50, p90,
max), wall time and per-instance split, and each variant's ratio to off within each round (and
their median over rounds).

With ``--lora-load-s S`` the emulators read an adapter that is not in host memory (vLLM's
default ``--max-cpu-loras`` = ``--max-loras``: only the adapter that ran last) for S model
seconds; ``--variants on,on_no_load,off`` then also runs affinity without weighing that load
(``routing.lora_load_s = 0``; ``on`` learns it from first tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import aiohttp

from bench.policy_rounds import ratios, round_orders
from config.admission_settings import AdmissionMode
from config.settings import Settings
from gateway.openai import COMPLETIONS
from gateway.stack import LiveStack, StackSpec


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests, the same for every run (seeded)."""
    rng = random.Random(args.seed)
    adapters = [f"lora{i}" for i in range(args.adapters)]
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    out = []
    for i in range(args.requests):
        words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randint(100, 400)))
        out.append(
            {
                "model": rng.choices(adapters, weights)[0],
                "prompt": f"request {i}: {words}",
                "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
                "stream": True,
            }
        )
    return out


async def _one(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, str]:
    t0 = time.monotonic()
    async with s.post(url + COMPLETIONS, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {await r.text()}")
        await r.content.readline()
        ttft = time.monotonic() - t0
        where = r.headers.get("x-kvgate-prefill", "?")
        await r.read()
    return ttft, where


VARIANTS = {  # name -> (routing.lora_affinity, routing.lora_load_s)
    "on": (True, None),
    "on_no_load": (True, 0.0),
    "off": (False, None),
}


async def run_once(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    adapters = tuple(f"lora{i}" for i in range(args.adapters))
    affinity, load_s = VARIANTS[variant]
    base = Settings()
    base = replace(
        base,
        routing=replace(
            base.routing, lora_adapters=adapters, lora_affinity=affinity, lora_load_s=load_s
        ),
        admission=replace(base.admission, mode=AdmissionMode.NONE),
        server=replace(base.server, refit_interval_s=0, scrape_interval_s=0.25),
    )
    stack = LiveStack(
        StackSpec(
            colocated=args.instances,
            time_scale=args.time_scale,
            model="base",
            lora_load_s=args.lora_load_s,
            base=base,
        )
    )
    await stack.start()
    try:
        todo = list(workload(args))
        ttfts: list[float] = []
        split: dict[str, int] = {}
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s:

            async def worker() -> None:
                while todo and time.monotonic() - t0 < args.max_seconds:
                    ttft, where = await _one(s, stack.url, todo.pop(0))
                    ttfts.append(ttft)
                    split[where] = split.get(where, 0) + 1

            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.monotonic() - t0
        loads = stack.gateway.conductor.lora.loads.as_dict()
    finally:
        await stack.stop()
    ttfts.sort()
    return {
        "lora_affinity": affinity,
        "lora_load_s": load_s,
        "requests": len(ttfts),
        "ttft_mean_s": round(statistics.fmean(ttfts), 4),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 4),
        "ttft_p90_s": round(ttfts[int(len(ttfts) * 0.9)], 4),
        "ttft_max_s": round(ttfts[-1], 4),
        "wall_s": round(wall, 2),
        "split": dict(sorted(split.items())),
        "lora_load": loads,  # what the gateway charged (learned) at the end
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--zipf", type=float, default=0.8, help="adapter popularity exponent")
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--time-scale", type=float, default=1.0, help="emulator wall s per model s")
    p.add_argument(
        "--lora-load-s",
        type=float,
        default=0.0,
        help="the emulators' load of an adapter not in host memory (model s); default 0",
    )
    p.add_argument(
        "--variants",
        default="on,off",
        help=f"comma-separated, of {', '.join(VARIANTS)}; ratios are to off (default on,off)",
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-seconds", type=float, default=300.0, help="per run, a bound")
    p.add_argument("--json", default=None, help="write the report here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or "off" not in variants or len(variants) < 2:
        known = ", ".join(VARIANTS)
        p.error(f"--variants {args.variants!r}: off and at least one other of {known}")
    runs = []
    for rnd, order in enumerate(round_orders(variants, args.rounds)):
        for which in order:
            run = asyncio.run(run_once(args, which))
            run.update(round=rnd, policy=f"affinity_{which}")
            runs.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    over_off = ratios(runs, "affinity_off", ("ttft_mean_s", "ttft_p90_s", "wall_s"))
    report: dict[str, Any] = {"args": vars(args), "runs": runs}
    for v in variants:
        if v != "off":
            report["on_over_off" if v == "on" else f"{v}_over_off"] = over_off[f"affinity_{v}"]
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
