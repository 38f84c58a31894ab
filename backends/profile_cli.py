"""`kvgate profile --target URL --model NAME --out FILE`: sweep, fit, write a profile file.

The sweep is backends/profiler.py, the fit predictors/calibration.py; this module asks the engine
what it can tell about its KV cache (vLLM's ``vllm:cache_config_info``, llama.cpp's ``/props``),
writes the file and prints a JSON summary on stdout. Exit 2 on bad arguments or an engine that
cannot be profiled, 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.profile_plan import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_CACHED_FRACTIONS,
    DEFAULT_DECODE_CONTEXTS,
    DEFAULT_PROMPT_TOKENS,
    SweepPlan,
)

if TYPE_CHECKING:
    import aiohttp


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(not 0.0 <= v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in [0, 1), got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure a live OpenAI-compatible engine (vLLM, llama.cpp's llama-server, kvgate's "
        "emulator) and write a predictor profile for it: prefill time by prompt length and "
        "cached fraction, decode step time by batch size and context. Use the file as "
        "predictors.profile_file in the gateway config."
    )
    p.add_argument("--target", required=True, help="engine base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True, help="the engine's served model name")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    p.add_argument("--name", help="profile name (default: the model name + '-measured')")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=3072,
        help="longest prompt swept; keep below the engine's context (default 3072)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_ints,
        default=DEFAULT_PROMPT_TOKENS,
        help="prompt lengths, comma-separated (default %(default)s, capped by --max-prompt-tokens)",
    )
    p.add_argument(
        "--cached-fractions",
        type=_fractions,
        default=DEFAULT_CACHED_FRACTIONS,
        help="fractions of each prompt sent first so the engine caches them (default %(default)s)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_ints,
        default=DEFAULT_BATCH_SIZES,
        help="concurrent decode streams (default %(default)s)",
    )
    p.add_argument(
        "--decode-contexts",
        type=_ints,
        default=DEFAULT_DECODE_CONTEXTS,
        help="prompt length of each decode stream (default %(default)s)",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="samples per prefill case (default 3; median fitted)"
    )
    p.add_argument(
        "--max-seconds", type=float, default=180.0, help="stop the sweep after this (default 180)"
    )
    p.add_argument(
        "--requests", type=int, default=400, help="stop after this many requests (default 400)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=1000,
        help="random prompt token ids are drawn below this (default 1000; fits any model)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="order of the sweep (prompts are always fresh)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class EngineLimits:
    kv_capacity_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    max_batch: int | None = None
    source: str = "not reported"


_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    import aiohttp

    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0, ""


async def engine_limits(session: aiohttp.ClientSession, target: str) -> EngineLimits:
    """KV capacity (and bytes per token, slots) where the engine reports them; else unknown."""
    base = target.rstrip("/")
    status, text = await _get(session, base + "/metrics")
    match = _CACHE_INFO.search(text) if status == 200 else None
    if match:
        labels = dict(_LABEL.findall(match.group(1)))
        tokens = _int(labels.get("kv_cache_size_tokens"))
        memory = _int(labels.get("kv_cache_memory_bytes"))
        return EngineLimits(
            kv_capacity_tokens=tokens,
            kv_bytes_per_token=memory // tokens if memory and tokens else None,
            source="vllm:cache_config_info",
        )
    status, text = await _get(session, base + "/props")
    if status == 200:
        try:
            props = json.loads(text)
        except ValueError:
            props = {}
        slots = _int(props.get("total_slots"))
        n_ctx = _int((props.get("default_generation_settings") or {}).get("n_ctx"))
        if slots and n_ctx:  # llama.cpp: n_ctx is each slot's context
            return EngineLimits(
                kv_capacity_tokens=slots * n_ctx, max_batch=slots, source="llama.cpp /props"
            )
    return EngineLimits()


def _int(value: Any) -> int | None:
    try:
        number = int(float(value))
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def plan_from_args(args: argparse.Namespace) -> SweepPlan:
    lengths = tuple(n for n in args.prompt_tokens if n <= args.max_prompt_tokens)
    if not lengths:
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens} leaves no prompt length")
    contexts = tuple(min(c, args.max_prompt_tokens) for c in args.decode_contexts)
    for name in ("repeats", "requests", "vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.vocab_size <= 20:
        raise ValueError("--vocab-size must be > 20")
    if not args.max_seconds > 0:
        raise ValueError("--max-seconds must be > 0")
    return SweepPlan(
        prompt_tokens=lengths,
        cached_fractions=args.cached_fractions,
        batch_sizes=args.batch_sizes,
        decode_contexts=contexts,
        repeats=args.repeats,
        max_seconds=args.max_seconds,
        max_requests=args.requests,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )


async def profile_engine(args: argparse.Namespace, plan: SweepPlan) -> dict[str, Any]:
    import aiohttp

    from backends.profile_file import write_profile_file
    from backends.profiler import EngineProfiler
    from predictors.calibration import fit_profile
    from replay.report.progress import ProgressBar

    progress = ProgressBar("kvgate profile", enabled=not args.quiet)
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a
    # write to a closed one fails; the connect cost on loopback is far below a prefill's.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        limits = await engine_limits(session, args.target)
        profiler = EngineProfiler(session, args.target, args.model, plan, progress=progress)
        result = await profiler.run()
    cal = fit_profile(
        result.samples,
        name=args.name or f"{args.model}-measured",
        model=args.model,
        target=args.target,
        kv_capacity_tokens=limits.kv_capacity_tokens,
        max_batch=limits.max_batch,
    )
    if limits.kv_bytes_per_token:
        cal = replace(
            cal, profile=replace(cal.profile, kv_bytes_per_token=limits.kv_bytes_per_token)
        )
    write_profile_file(args.out, cal)
    p, q = cal.profile, cal.quality
    return {
        "out": str(Path(args.out)),
        "name": p.name,
        "requests": result.requests,
        "errors": result.errors,
        "last_error": result.last_error,
        "elapsed_s": round(result.elapsed_s, 2),
        "stopped_early": result.stopped_early,
        "token_id_prompts": result.token_ids,
        "prefill": {
            "a_ms": p.prefill.a_ms,
            "b_ms": p.prefill.b_ms,
            "n0": p.prefill.n0,
            "c_ms": p.prefill.c_ms,
            "samples": q.prefill_samples,
            "mape_pct": round(q.prefill_mape_pct, 2),
        },
        "decode": {
            "a_ms": p.decode.a_ms,
            "b_ms": p.decode.b_ms,
            "k_ms": p.decode.k_ms,
            "samples": q.decode_samples,
            "mape_pct": None if q.decode_mape_pct is None else round(q.decode_mape_pct, 2),
        },
        "kv_capacity_tokens": p.kv_capacity_tokens,
        "limits_source": limits.source,
        "predicted_ms": {
            f"{n}_cold": round(p.prefill.gpu_ms(n, 0), 2) for n in (128, 512, 1024, 2048)
        },
    }


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        print(f"kvgate profile: {exc}", file=sys.stderr)
        return 2
    from backends.profiler import ProfileError

    try:
        summary = asyncio.run(profile_engine(args, plan))
    except (ProfileError, ValueError, OSError) as exc:
        print(f"kvgate profile: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0
