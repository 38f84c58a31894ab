"""`kvgate replay`: open-loop live load from a trace against a running gateway.

Each trace request is sent at its (speed-adjusted) timestamp whether or not earlier ones have
finished. Hash ids become fixed pseudo-random blocks of token ids, so requests sharing hash
ids share a real token prefix. TTFT, TBT and the outcome of every request are measured and
summarised in the same report format as ``kvgate sim``. With time-scaled emulators
(``--time-scale``), arrivals are compressed and measured times stretched back by that factor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from backends.transport import IDLE_KEEPALIVE_S
from replay.report.progress import ProgressBar
from replay.report.results import Outcome, RequestOutcome, RunResult
from replay.workload.traces import BLOCK_SIZE, TraceError, TraceRequest, load_trace, select
from routing.hashing import block_tokens_for_id
from routing.prompt import count_stream_tokens


@dataclass(frozen=True, slots=True)
class LoadOptions:
    target: str  # gateway base URL
    time_scale: float = 1.0  # wall seconds per model second (emulators' --time-scale)
    model: str | None = None  # None: no model field (the engine's own model, as vLLM defaults)
    label: str = "live"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    timeout_s: float = 600.0


def prompt_ids(tr: TraceRequest, cache: dict[int, list[int]]) -> list[int]:
    """The prompt's token ids: one fixed block per hash id, cut to the input length."""
    ids: list[int] = []
    for h in tr.hash_ids:
        block = cache.get(h)
        if block is None:
            block = cache[h] = block_tokens_for_id(h, BLOCK_SIZE)
        ids.extend(block)
    if not tr.hash_ids:  # CSV traces have no prefix information: unique tokens
        ids = block_tokens_for_id(10**12 + tr.index, max(tr.input_length, 1))
    return ids[: tr.input_length]


async def send_one(
    session: aiohttp.ClientSession,
    tr: TraceRequest,
    ids: list[int],
    opts: LoadOptions,
    t0: float,
    out: RequestOutcome,
) -> None:
    scale = opts.time_scale
    body: dict[str, object] = {
        "prompt": ids,
        "max_tokens": max(tr.output_length, 1),
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if opts.model is not None:  # a made-up name would be a 404 at a real engine
        body["model"] = opts.model
    headers = {"X-Request-Id": f"replay-{tr.index}"}
    sent = time.perf_counter()
    out.arrival_s = (sent - t0) / scale
    first = last = None
    tokens = 0
    try:
        async with session.post(
            opts.target + "/v1/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=opts.timeout_s),
        ) as resp:
            if resp.status != 200:
                payload = await resp.read()
                out.outcome = (
                    Outcome.REJECTED
                    if resp.headers.get("x-kvgate-reject-reason")
                    else (Outcome.REJECTED_AFTER_PREFILL if resp.status == 503 else Outcome.FAILED)
                )
                out.reason = resp.headers.get("x-kvgate-reject-reason") or _message(payload)
                return
            out.prefill_instance = resp.headers.get("x-kvgate-prefill")
            out.decode_instance = resp.headers.get("x-kvgate-decode")
            pred = resp.headers.get("x-kvgate-predicted-ttft-ms")
            out.predicted_ttft_s = float(pred) / 1000 / scale if pred else None
            out.best_effort = resp.headers.get("x-kvgate-admission") == "best-effort"
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                n = count_stream_tokens(chunk)
                if b'"error"' in chunk:
                    out.outcome, out.reason = Outcome.FAILED, "error event mid-stream"
                    return
                if n and first is None:
                    first = now
                if n:
                    last = now
                    tokens += n
                if b'"usage":{' in chunk:
                    out.cached_tokens = _cached_tokens(chunk)
    except (TimeoutError, aiohttp.ClientError) as exc:
        out.outcome, out.reason = Outcome.FAILED, type(exc).__name__
        return
    if first is None:
        out.outcome, out.reason = Outcome.FAILED, "no tokens"
        return
    out.outcome = Outcome.COMPLETED
    out.ttft_s = (first - sent) / scale
    out.finish_s = (last - t0) / scale if last else None
    out.generated = tokens
    if tokens > 1 and last is not None:
        out.tbt_mean_s = (last - first) / (tokens - 1) / scale


def _cached_tokens(chunk: bytes) -> int:
    """prompt_tokens_details.cached_tokens from the stream's usage event."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage":{' in line:
            try:
                usage = json.loads(line[6:]).get("usage") or {}
                return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            except (ValueError, TypeError, AttributeError):
                return 0
    return 0


def _message(payload: bytes) -> str:
    try:
        return str(json.loads(payload)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return payload[:200].decode("utf-8", "replace")


async def run_load(
    trace: list[TraceRequest], opts: LoadOptions, progress: ProgressBar | None = None
) -> RunResult:
    result = RunResult(
        label=opts.label,
        policy="live",
        admission="live",
        ttft_slo_s=opts.ttft_slo_s,
        tbt_slo_s=opts.tbt_slo_s,
        duration_s=(trace[-1].arrival_s - trace[0].arrival_s) if trace else 0.0,
    )
    cache: dict[int, list[int]] = {}
    outcomes = [
        RequestOutcome(f"replay-{tr.index}", tr.arrival_s, tr.input_length, tr.output_length)
        for tr in trace
    ]
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_KEEPALIVE_S)
    start = time.perf_counter()
    done = 0

    def finished(_: asyncio.Task[None]) -> None:
        # As each answer ends, while later requests are still to be sent: counting only after
        # the last send left a run's progress silent until its arrivals were over.
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, len(trace))

    async with aiohttp.ClientSession(connector=connector) as session:
        tasks = []
        for tr, out in zip(trace, outcomes, strict=True):
            ids = prompt_ids(tr, cache)
            delay = tr.arrival_s * opts.time_scale - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(session, tr, ids, opts, start, out))
            task.add_done_callback(finished)
            tasks.append(task)
        await asyncio.gather(*tasks)
    result.requests = outcomes
    result.wall_s = time.perf_counter() - start
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL or CSV trace")
    p.add_argument("--target", required=True, help="gateway URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--speed", type=float, default=1.0, help="load factor (arrivals / speed)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per model second, as given to the emulators",
    )
    p.add_argument("--start", type=float, help="window start, seconds into the trace")
    p.add_argument("--duration", type=float, help="window length, seconds of trace time")
    p.add_argument("--limit", type=int, help="at most this many requests")
    p.add_argument("--sample", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=30.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument(
        "--model",
        help="the requests' model field (needed when the gateway has a models table); "
        "default: none, so the engines serve their own model",
    )
    p.add_argument("--label", default="live")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--quiet", action="store_true")


def main(args: argparse.Namespace) -> int:
    from replay.report.report import format_table, summarize, write_json

    try:
        if args.time_scale <= 0:
            raise ValueError("--time-scale must be > 0")
        trace = select(
            load_trace(args.trace),
            speed=args.speed,
            start_s=args.start,
            duration_s=args.duration,
            sample=args.sample,
            limit=args.limit,
            seed=args.seed,
        )
        if not trace:
            raise ValueError("the selection left no requests")
    except (TraceError, ValueError, OSError) as exc:
        print(f"kvgate replay: {exc}", file=sys.stderr)
        return 2
    opts = LoadOptions(
        args.target.rstrip("/"),
        args.time_scale,
        model=args.model,
        label=args.label,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
    )
    result = asyncio.run(run_load(trace, opts, ProgressBar(args.label, enabled=not args.quiet)))
    summary = summarize(result)
    print(format_table([summary]))
    if args.json:
        write_json(
            Path(args.json),
            [summary],
            extra={"trace": args.trace, "speed": args.speed, "time_scale": args.time_scale},
        )
    if args.plots:
        from replay.report.plots import write_plots

        write_plots([result], Path(args.plots))
    return 0
