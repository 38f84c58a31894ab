"""How long a long prompt holds the gateway's event loop, with and without tokenizing ahead.

The gateway's completion handler runs in-process (bench/hot_path_cost.py's fake engine and
config) with the engine-exact encoder of ``--model-dir``. One client sends short chat
requests back to back (the proxy benchmark's bodies: a cached system prompt, a short user
turn) and measures each one's time through the handler; another sends ``--long`` requests,
each a unique document of ``--doc-chars`` characters, ``--gap-ms`` apart; a ticker sleeping
1 ms records how late the loop wakes it. Both modes run in every round, alternating which
goes first (``--rounds``):

- ``on_loop``: ``routing.tokenize_offload_chars = 0`` (every prompt tokenized on the loop);
- ``ahead``: the default threshold: long prompts tokenized in a worker thread
  (gateway/tokenize_ahead.py), the loop serving the short requests meanwhile.

Reported per mode (medians over rounds): the loop's lateness p50/p99/max, the short
requests' time p50/p99, how many short requests were served during the run, and the
process CPU per long request. The run is bounded by ``--long`` and ``--budget-s``.

    python -m bench.loop_stall --json out/loop-stall.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.hot_path_cost import CHAT, FakeDriver, body_receiver, chat_body, load_config
from config.settings import Settings

DEFAULT_MODEL_DIR = Path.home() / ".cache/kvgate-engines/vllm-0.32.0/tiny-model"
_TEXT = (
    "the cache holds the prefix of a long document while the gateway routes requests to "
    "engines and each block of tokens is hashed with its parent block 2024 results,"
)
_WORDS = _TEXT.split()


def document(i: int, chars: int) -> str:
    """A unique text of about ``chars`` characters (its number and a word order of its own)."""
    out, n, k = [f"Document {i}:"], 0, i
    while n < chars:
        k = (k * 1103515245 + 12345) % (1 << 31)
        word = _WORDS[k % len(_WORDS)]
        out.append(word)
        n += len(word) + 1
    return " ".join(out)


def long_body(i: int, chars: int) -> bytes:
    messages = [
        {"role": "system", "content": "Summarise the document."},
        {"role": "user", "content": document(i, chars)},
    ]
    body = {"model": "m", "messages": messages, "max_tokens": 16, "stream": True}
    return json.dumps(body).encode()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _run(settings: Settings, args: argparse.Namespace, start: int) -> dict[str, Any]:
    from gateway.app import build_app
    from gateway.gc_tuning import tune_gc
    from gateway.proxy import CompletionHandler

    gw = build_app(settings).gateway
    tune_gc()  # as kvgate serve does
    gw.driver = FakeDriver()  # type: ignore[assignment]
    handler = CompletionHandler(gw)
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": headers}
    longs = [long_body(start + i, args.doc_chars) for i in range(args.long)]
    shorts = [chat_body(i) for i in range(256)]

    async def send(message: dict[str, Any]) -> None:
        pass

    async def call(body: bytes) -> None:
        await handler(scope, body_receiver(body, never), send)

    for body in shorts:  # the shared system prompt into the segment cache, code warm
        await call(body)
    done = asyncio.Event()
    lateness: list[float] = []
    short_s: list[float] = []
    long_s: list[float] = []

    async def ticker() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lateness.append(time.perf_counter() - t0 - 0.001)

    async def short(body: bytes, due: float) -> None:
        await call(body)
        short_s.append(time.perf_counter() - due)  # from when it was due: waits count

    async def short_client() -> None:
        """``--short-rate`` requests a second, each on time whatever the others do (open
        loop); 0: back to back, each after the last (a loop with no idle moment at all)."""
        k, due = 0, time.perf_counter()
        pending = []
        while not done.is_set():
            body = shorts[k % len(shorts)]
            k += 1
            if args.short_rate <= 0:
                t0 = time.perf_counter()
                await short(body, t0)
                await asyncio.sleep(0)  # let the long client and the ticker in
                continue
            due += 1.0 / args.short_rate
            wait = due - time.perf_counter()
            await asyncio.sleep(max(wait, 0.0))
            pending.append(asyncio.create_task(short(body, due)))
        await asyncio.gather(*pending)

    async def timed(body: bytes) -> None:
        t0 = time.perf_counter()
        await call(body)
        long_s.append(time.perf_counter() - t0)

    async def long_client() -> None:
        tasks = []
        deadline = time.perf_counter() + args.budget_s
        for body in longs:
            if time.perf_counter() > deadline:
                break
            tasks.append(asyncio.create_task(timed(body)))
            await asyncio.sleep(args.gap_ms / 1000)
        await asyncio.gather(*tasks)
        done.set()

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(ticker(), short_client(), long_client())
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    if gw.conductor.requests:
        raise RuntimeError("requests left in the books: the fake engine path is broken")
    ms = 1000.0
    return {
        "loop_late_ms_p50": round(_pct(lateness, 0.5) * ms, 3),
        "loop_late_ms_p99": round(_pct(lateness, 0.99) * ms, 3),
        "loop_late_ms_max": round(max(lateness, default=0.0) * ms, 3),
        "short_ms_p50": round(_pct(short_s, 0.5) * ms, 3),
        "short_ms_p99": round(_pct(short_s, 0.99) * ms, 3),
        "short_requests": len(short_s),
        "long_ms_p50": round(_pct(long_s, 0.5) * ms, 3),
        "long_ms_max": round(max(long_s, default=0.0) * ms, 3),
        "wall_s": round(wall, 3),
        "cpu_ms_per_long_request": round(cpu / max(len(longs), 1) * ms, 2),
        "tokenized_in_thread": gw.tokenizing.delivered,
        "thread_given_up": gw.tokenizing.gave_up,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {"on_loop": [], "ahead": []}
    with tempfile.TemporaryDirectory() as d:
        base = load_config(Path(d))
    for r in range(args.rounds):
        order = ["on_loop", "ahead"] if r % 2 == 0 else ["ahead", "on_loop"]
        for mode in order:
            limit = 0 if mode == "on_loop" else args.offload_chars
            routing = replace(
                base.routing, model_dir=str(args.model_dir), tokenize_offload_chars=limit
            )
            settings = replace(base, routing=routing)
            start = (r * 2 + len(rounds[mode])) * args.long  # unique documents every run
            rounds[mode].append(asyncio.run(_run(settings, args, start)))
            print(f"round {r + 1}/{args.rounds} {mode}: {rounds[mode][-1]}", file=sys.stderr)
    medians = {
        mode: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        for mode, runs in rounds.items()
    }
    return {
        "model_dir": str(args.model_dir),
        "doc_chars": args.doc_chars,
        "long_requests": args.long,
        "gap_ms": args.gap_ms,
        "short_rate": args.short_rate,
        "offload_chars": args.offload_chars,
        "rounds": args.rounds,
        "median": medians,
        "runs": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loop_stall", description=__doc__)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--doc-chars", type=int, default=32_000, help="characters per long prompt")
    p.add_argument("--long", type=int, default=40, help="long requests per run")
    p.add_argument("--gap-ms", type=float, default=20.0, help="between long requests")
    rate = "short requests per second (0: back to back, a loop never idle)"
    p.add_argument("--short-rate", type=float, default=2000.0, help=rate)
    p.add_argument("--offload-chars", type=int, default=8192, help="the 'ahead' threshold")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=60.0, help="time cap per run")
    p.add_argument("--json", type=Path, help="write the result here")
    a = p.parse_args(argv)
    if a.doc_chars < 1 or a.long < 1 or a.rounds < 1 or a.gap_ms < 0 or a.offload_chars < 1:
        p.error("--doc-chars, --long, --rounds, --offload-chars must be >= 1, --gap-ms >= 0")
    if not (a.model_dir / "tokenizer.json").is_file():
        p.error(f"no tokenizer.json in {a.model_dir} (run engines/setup.sh, or --model-dir)")
    result = measure(a)
    print(json.dumps(result["median"], indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
