"""What one proxied request costs kvgate's own code, without sockets, in CPU time or instructions.

The gateway's completion handler runs in-process against a fake engine (16 SSE chunks, written
back at once) and a no-op ASGI ``send``; ``--part core`` runs only the Conductor's lifecycle
(schedule, dispatched, first token, tokens, finished) for the same prompts. Requests are the
proxy benchmark's chat bodies (a shared ~800-character system prompt, a unique user turn).

CPU time on a shared machine moves by 10-30% between runs; instruction counts do not. With
``--callgrind`` the script re-runs itself under valgrind (``valgrind --tool=callgrind``, must be
installed) for 1 and for 1 + N requests and reports the difference per request, which
excludes start-up. That is the number to compare two builds by (docs/proxy-bench.md).

    python -m bench.hot_path_cost                      # CPU us per request (median of reps)
    python -m bench.hot_path_cost --callgrind --json out/hot-path.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

CONFIG = """
[server]
health_interval_s = 3600.0
scrape_interval_s = 3600.0
refit_interval_s = 0
[routing]
policy = "kvcache_centric"
[admission]
mode = "predictive"
[replication]
enabled = false
[[pools]]
name = "workers"
role = "both"
""" + "".join(
    f'[[pools.instances]]\nid = "w{i}"\nurl = "http://127.0.0.1:{18001 + i}"\nprotocol = "vllm"\n'
    for i in range(4)
)
SYSTEM = "You are a careful assistant for a retail bank. Answer briefly. " * 13
EVENT = (
    b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
CHUNKS = [EVENT] * 16 + [b"data: [DONE]\n\n"]
CHAT = "/v1/chat/completions"


def chat_body(i: int) -> bytes:
    user = (
        f"Request {i:05d}: summarise account activity for customer {i * 7919} in region "
        f"{i % 17}, list the three largest transactions, and flag anything unusual. "
        + f"ctx{i:03d} "
        * 8
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    body = {"model": "stub-model", "messages": messages, "max_tokens": 16, "stream": True}
    return json.dumps(body).encode()


class FakeEngineAnswer:
    """The ``UpstreamResponse`` surface the relay uses, with every chunk already there."""

    status = 200
    content_type = "text/event-stream"
    instance_id = "w0"

    def __init__(self) -> None:
        self._next = 0

    async def next_chunk(self) -> bytes | None:
        if self._next >= len(CHUNKS):
            return None
        self._next += 1
        return CHUNKS[self._next - 1]

    async def next_piece(self) -> tuple[bytes, bool] | None:
        chunk = await self.next_chunk()
        return None if chunk is None else (chunk, self.complete)

    def piece_reader(self):
        return self.next_piece

    @property
    def complete(self) -> bool:
        return self._next >= len(CHUNKS)

    def close(self) -> None:
        pass


def body_receiver(body: bytes, never: asyncio.Future[None]) -> Callable[[], Awaitable[dict]]:
    """An ASGI ``receive`` that hands over ``body`` once, then waits on ``never``: a client
    that stays connected."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never
        raise AssertionError

    return receive


class FakeDriver:
    async def open(self, session: Any, plan: Any) -> FakeEngineAnswer:
        return FakeEngineAnswer()


def load_config(tmp: Path):
    """The benchmark's gateway config (4 colocated instances), loaded as kvgate loads one."""
    from config.loader import load_settings

    path = tmp / "hot-path.toml"
    path.write_text(CONFIG)
    return load_settings(path)


async def _handler_run(n: int, reps: int, tmp: Path, unique: bool = False) -> list[float]:
    from gateway.app import build_app
    from gateway.gc_tuning import tune_gc
    from gateway.proxy import CompletionHandler

    gw = build_app(load_config(tmp)).gateway
    gw.driver = FakeDriver()  # type: ignore[assignment]
    handler = CompletionHandler(gw)
    tune_gc()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    # 256 bodies cycled (the proxy benchmark's), or a new user turn for every request: the
    # exact encoder's segment cache then finds only the shared system prompt, as in real traffic.
    count = n * reps if unique else 256
    bodies = [chat_body(i) for i in range(count)]
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": headers}

    async def send(message: dict[str, Any]) -> None:
        pass

    per_request = []
    k = 0
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(n):
            await handler(scope, body_receiver(bodies[k % count], never), send)
            k += 1
        per_request.append((time.process_time() - t0) / max(n, 1) * 1e6)
    if gw.conductor.requests:
        raise RuntimeError("requests left in the books: the fake engine path is broken")
    return per_request


def _core_run(n: int, reps: int, tmp: Path) -> list[float]:
    from gateway.openai import parse_request
    from gateway.runtime import Gateway

    settings = load_config(tmp)
    gw = Gateway(settings)
    parse = [
        parse_request(
            CHAT, chat_body(i), {}, f"r{i}", 0.0,
            settings=settings, encoder=gw.prompt_encoder, hasher=gw.hasher,
        ).info
        for i in range(256)
    ]  # fmt: skip
    c, now, k = gw.conductor, 1000.0, 0
    per_request = []
    for _ in range(reps):
        in_flight: list[str] = []
        t0 = time.process_time()
        for _ in range(n):
            info = dataclasses.replace(parse[k % 256], request_id=f"q{k}")
            k += 1
            now += 0.001
            decision = c.schedule(info, now)
            c.dispatched(decision, info, now)  # type: ignore[arg-type]
            in_flight.append(info.request_id)
            if len(in_flight) > 8:  # a few requests in flight, as in a busy gateway
                rid = in_flight.pop(0)
                c.first_token(rid, now + 1e-4)
                c.tokens(rid, 16, now + 2e-4)
                c.finished(rid, now + 3e-4, output_tokens=16)
        per_request.append((time.process_time() - t0) / max(n, 1) * 1e6)
    return per_request


def measure(part: str, n: int, reps: int, unique: bool = False) -> list[float]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        if part == "core":
            return _core_run(n, reps, Path(d))
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency of kvgate serve
            return asyncio.run(_handler_run(n, reps, Path(d), unique))
        return uvloop.run(_handler_run(n, reps, Path(d), unique))


def _instructions(part: str, n: int, unique: bool = False) -> int:
    """Instructions of a whole run under callgrind (fixed hash seed, no ASLR if possible)."""
    cmd = [sys.executable, "-m", "bench.hot_path_cost", "--part", part, "--requests", str(n)]
    cmd += ["--reps", "1", "--quiet", *(["--unique"] if unique else [])]
    prefix = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    out = subprocess.run(
        [*prefix, "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        cwd=Path(__file__).resolve().parents[1],
        timeout=3600,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or not found:
        raise RuntimeError(f"callgrind run failed: {out.stderr[-2000:]}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hot_path_cost", description=__doc__)
    p.add_argument("--part", choices=["handler", "core"], default="handler")
    p.add_argument("--requests", type=int, default=2000, help="requests per repetition")
    p.add_argument("--reps", type=int, default=15, help="repetitions (CPU time: median)")
    p.add_argument("--callgrind", action="store_true", help="count instructions instead")
    unique = "handler: a new user turn for every request (default: 256 bodies cycled)"
    p.add_argument("--unique", action="store_true", help=unique)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.requests < 1 or a.reps < 1:
        p.error("--requests and --reps must be >= 1")
    if a.callgrind:
        if not shutil.which("valgrind"):
            print("bench.hot_path_cost: --callgrind needs valgrind on PATH", file=sys.stderr)
            return 2
        print(f"callgrind: 1 and {1 + a.requests} requests ({a.part})...", file=sys.stderr)
        base = _instructions(a.part, 1, a.unique)
        full = _instructions(a.part, 1 + a.requests, a.unique)
        result: dict[str, Any] = {
            "part": a.part,
            "requests": a.requests,
            "instructions_per_request": round((full - base) / a.requests),
        }
    else:
        times = measure(a.part, a.requests, a.reps, a.unique)
        if a.quiet:
            return 0
        result = {
            "part": a.part,
            "requests": a.requests,
            "reps": a.reps,
            "unique_prompts": a.unique,
            "cpu_us_per_request_median": round(statistics.median(times), 1),
            "cpu_us_per_request_min": round(min(times), 1),
        }
    print(json.dumps(result))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
