"""What a rejected request costs the gateway, stage by stage, in-process (no sockets).

The fleet of the overload benchmark (one prefill and one decode instance, profile
``llama3-8b-h100-tp1``, admission ``early``, TTFT SLO 1 s) with 2 s of prefill queued, so that
every request is rejected for ``ttft_slo``; each request asks ``x-slo-ttft-ms: 1`` (clamped to
``slo.min_ttft_s``). Three ~``--tokens`` prompts, each request its own (nothing is cached):

- ``ids``: a completion whose prompt is a list of token ids (what ``bench.overload_soak``'s
  client sends: a ~25 KB body);
- ``text``: a completion whose prompt is text;
- ``chat``: a chat completion (system and user messages).

Per request and stage, with ``time.perf_counter_ns``:

- ``full`` (the path before the hopeless check, and still the path when it does not apply):
  ``body_read`` (ASGI receive, 64 KiB messages), ``json_parse``, ``tokenize`` (render and
  encode the prompt), ``block_hash``, ``schedule`` (the Conductor's full decision: a
  rejection), ``answer`` (the 429's headers and body, sent to a no-op ASGI ``send``);
- ``hopeless`` (routing/hopeless.py): ``body_read``, ``json_parse`` (``parse_head``),
  ``check`` (``head_info`` + ``Conductor.reject_hopeless``), ``answer``.

And the whole ``CompletionHandler`` call for each path (``handler_full`` runs a handler whose
hopeless check is turned off). Medians over ``--reps`` repetitions of ``--requests`` requests
(each repetition's median and p99 per stage), with the gateway's GC tuning. Wall time in
microseconds; on a shared machine compare the two paths within one run.

``--live URL`` instead sends such requests to a running gateway over HTTP: one sequential
client (``http.client``, one keep-alive connection, bodies serialized beforehand) posting
``ids`` prompts with ``x-slo-ttft-ms: 1`` every ``--every-ms`` for ``--seconds``, timing each
answer from the first byte sent to the last byte read. It records the wall-clock time of each
send (so ``bench.overload_soak --reject-probe`` can assign it to a load phase), the status, the
rejection reason and whether the hopeless check answered it (its message says so).

    python -m bench.rejection_path --json out/rejection-path.json
    python -m bench.rejection_path --live http://127.0.0.1:18500 --seconds 60 --json probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The in-process part imports the gateway where it runs: ``--live`` (a client only) must also
# run from a tree without the hopeless check, to measure the gateway before it.
if TYPE_CHECKING:
    from gateway.proxy import CompletionHandler
    from gateway.runtime import Gateway

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KINDS = ("ids", "text", "chat")
HEADERS = {"content-type": "application/json", "x-slo-ttft-ms": "1"}
_WORDS = (
    *("the", "cache", "holds", "prefix", "prompt", "gateway", "routes", "instance", "block"),
    *("tokens", "hashed", "parent", "engine", "request", "decode", "prefill", "latency"),
    *("budget", "careful", "assistant", "answer", "question", "policy", "system"),
)


def settings(model_dir: str | None = None):
    from config.loader import settings_from_dict

    routing: dict[str, Any] = {"policy": "kvcache_centric", "block_size": 16}
    if model_dir:
        routing["model_dir"] = model_dir
    return settings_from_dict(
        {
            "slo": {"ttft_s": 1.0, "tbt_s": 0.1},
            "routing": routing,
            "admission": {"mode": "early"},
            "predictors": {"profile": "llama3-8b-h100-tp1"},
            "server": {"health_interval_s": 3600.0, "refit_interval_s": 0},
            "pools": [
                {"name": "prefill", "role": "prefill", "instances": [{"id": "p0", "url": "http://127.0.0.1:21901"}]},
                {"name": "decode", "role": "decode", "instances": [{"id": "d0", "url": "http://127.0.0.1:21902"}]},
            ],
        }
    )  # fmt: skip


def body(kind: str, i: int, tokens: int) -> bytes:
    """A ~``tokens``-token request body, unique to ``i``."""
    rng = random.Random(i)
    if kind == "ids":
        prompt: Any = [rng.randrange(100, 32000) for _ in range(tokens)]
        return json.dumps({"model": "kvgate", "prompt": prompt, "max_tokens": 64}).encode()
    # ~4 characters per token (the approximate tokenizer's rate; real ones are close)
    text = " ".join(rng.choice(_WORDS) for _ in range(tokens * 4 // 7))
    if kind == "text":
        return json.dumps({"model": "kvgate", "prompt": f"{i} {text}", "max_tokens": 64}).encode()
    half = len(text) // 2
    messages = [
        {"role": "system", "content": text[:half]},
        {"role": "user", "content": f"{i} {text[half:]}"},
    ]
    return json.dumps({"model": "kvgate", "messages": messages, "max_tokens": 64}).encode()


def _receiver(raw: bytes) -> Callable[[], Any]:
    parts = [raw[k : k + 65536] for k in range(0, len(raw), 65536)] or [b""]
    it = iter(range(len(parts)))

    async def receive() -> dict[str, Any]:
        k = next(it)
        return {"type": "http.request", "body": parts[k], "more_body": k < len(parts) - 1}

    return receive


async def _noop_send(message: dict[str, Any]) -> None:
    pass


def loaded_gateway(model_dir: str | None = None) -> Gateway:
    from gateway.runtime import Gateway

    gw = Gateway(settings(model_dir), clock=lambda: 1000.0)
    gw.conductor.instances["p0"].enqueue_prefill("filler", 2.0, 4096, 1000.0, 1000.0)
    return gw


async def _full(gw: Gateway, path: str, raw: bytes, rid: str) -> dict[str, int]:
    from gateway.answers import read_body, rejection_response, send_json
    from gateway.openai import parse_head
    from routing.types import Rejection, RequestInfo

    t: dict[str, int] = {}
    c = time.perf_counter_ns
    t0 = c()
    got = await read_body(_receiver(raw), gw.settings.server.max_body_bytes)
    t1 = c()
    head = parse_head(got, gw.model_routes)
    t2 = c()
    tokens = gw.prompt_encoder.encode(path, head.body)
    t3 = c()
    blocks = gw.hasher.hash_packed(tokens.packed)
    t4 = c()
    info = RequestInfo(rid, tokens.n_tokens, blocks, 64, 1000.0, slo_ttft_s=0.001)
    out = gw.conductor.schedule(info, 1000.0)
    t5 = c()
    assert isinstance(out, Rejection) and out.reason.value == "ttft_slo", out
    await send_json(_noop_send, *rejection_response(out, rid))
    t6 = c()
    t.update(
        body_read=t1 - t0,
        json_parse=t2 - t1,
        tokenize=t3 - t2,
        block_hash=t4 - t3,
        schedule=t5 - t4,
        answer=t6 - t5,
        total=t6 - t0,
    )
    t["prompt_tokens"] = tokens.n_tokens
    return t


async def _hopeless(gw: Gateway, path: str, raw: bytes, rid: str) -> dict[str, int]:
    from gateway.answers import read_body, rejection_response, send_json
    from gateway.openai import head_info, parse_head

    c = time.perf_counter_ns
    t0 = c()
    got = await read_body(_receiver(raw), gw.settings.server.max_body_bytes)
    t1 = c()
    head = parse_head(got, gw.model_routes)
    t2 = c()
    info = head_info(path, head, HEADERS, rid, 1000.0, gw.settings)
    assert info is not None
    out = gw.conductor.reject_hopeless(info, 1000.0)
    t3 = c()
    assert out is not None
    await send_json(_noop_send, *rejection_response(out, rid))
    t4 = c()
    return dict(body_read=t1 - t0, json_parse=t2 - t1, check=t3 - t2, answer=t4 - t3, total=t4 - t0)


async def _handler(handler: CompletionHandler, path: str, raw: bytes) -> dict[str, int]:
    headers = [(k.encode(), v.encode()) for k, v in HEADERS.items()]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    t0 = time.perf_counter_ns()
    await handler(scope, _receiver(raw), send)
    total = time.perf_counter_ns() - t0
    assert status == [429], status
    return {"total": total}


def _stats(rows: list[dict[str, int]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in rows[0]:
        if key == "prompt_tokens":
            continue
        us = sorted(r[key] / 1000 for r in rows)
        p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
        out[key] = {"p50": statistics.median(us), "p99": p99}
    return out


def _median_of(reps: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        stage: {q: round(statistics.median(r[stage][q] for r in reps), 1) for q in ("p50", "p99")}
        for stage in reps[0]
    }


async def run(requests: int, reps: int, tokens: int, model_dir: str | None) -> dict[str, Any]:
    from gateway.gc_tuning import tune_gc
    from gateway.proxy import CompletionHandler

    class FullPathHandler(CompletionHandler):
        """The handler with its hopeless check off: the path before it existed."""

        async def _hopeless(self, *args: Any) -> bool:
            return False

    gw = loaded_gateway(model_dir)
    tune_gc()  # as kvgate serve does once it is built
    full_handler, fast_handler = FullPathHandler(gw), CompletionHandler(gw)
    result: dict[str, Any] = {
        "encoder_exact": gw.prompt_encoder.exact,
        "tokens": tokens,
        "requests": requests,
        "reps": reps,
        "kinds": {},
    }
    for kind in KINDS:
        path = CHAT if kind == "chat" else COMPLETIONS
        per: dict[str, list[dict[str, dict[str, float]]]] = {
            "full": [],
            "hopeless": [],
            "handler_full": [],
            "handler_hopeless": [],
        }
        n_tokens, sizes = 0, []
        for rep in range(reps):
            rows: dict[str, list[dict[str, int]]] = {name: [] for name in per}
            for i in range(requests):
                # A prompt of its own for each path: the hasher's memo must not carry over.
                k = 4 * (rep * requests + i)
                raws = [body(kind, k + j, tokens) for j in range(4)]
                sizes.append(len(raws[0]))
                rid = f"{kind}-{rep}-{i}"
                row = await _full(gw, path, raws[0], rid)
                n_tokens = row.pop("prompt_tokens")
                rows["full"].append(row)
                rows["hopeless"].append(await _hopeless(gw, path, raws[1], rid))
                rows["handler_full"].append(await _handler(full_handler, path, raws[2]))
                rows["handler_hopeless"].append(await _handler(fast_handler, path, raws[3]))
            for name, got in rows.items():
                per[name].append(_stats(got))
        result["kinds"][kind] = {
            "path": path,
            "body_bytes": round(statistics.mean(sizes)),
            "prompt_tokens": n_tokens,
            **{name: _median_of(reps_) for name, reps_ in per.items()},
        }
    if gw.conductor.requests:
        raise RuntimeError("a rejected request was booked")
    return result


HOPELESS_MARK = b"shortest queue wait"  # in the hopeless check's rejection message


def live_probe(url: str, seconds: float, every_ms: float, tokens: int) -> dict[str, Any]:
    """Sequential rejected requests against ``url`` for ``seconds`` (bounded in count)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    headers = {**HEADERS, "connection": "keep-alive"}
    bodies = [body("ids", 10**6 + i, tokens) for i in range(64)]  # reused: nothing is admitted
    rows: list[list[Any]] = []  # [epoch_s, ms, status, reason, hopeless]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    end = time.monotonic() + seconds
    n_max = int(seconds * 1000 / max(every_ms, 1.0)) + 1
    for i in range(n_max):
        if time.monotonic() >= end:
            break
        epoch, t0 = time.time(), time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", bodies[i % len(bodies)], headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
            rows.append([epoch, None, None, "client_error", False])
            continue
        ms = (time.perf_counter() - t0) * 1e3
        reason = resp.getheader("x-kvgate-reject-reason")
        rows.append([epoch, round(ms, 3), resp.status, reason, HOPELESS_MARK in data])
        if resp.status == 200:  # admitted after all: do not leave it half read
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
        pause = every_ms / 1000 - (time.perf_counter() - t0)
        if pause > 0:
            time.sleep(pause)
    conn.close()
    return {"url": url, "tokens": tokens, "every_ms": every_ms, "rows": rows}


def start_live_probe(url: str, out: Path, seconds: float, every_ms: float) -> subprocess.Popen:
    """``--live`` in a child process (the caller's event loop must not delay its timings)."""
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.rejection_path", "--live", url, "--json", str(out)]
    cmd += ["--seconds", f"{seconds:g}", "--every-ms", f"{every_ms:g}"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def live_probe_rows(proc: subprocess.Popen, out: Path, timeout_s: float = 60.0) -> list[list[Any]]:
    """The rows of a ``start_live_probe`` child once it ends (killed by PID after
    ``timeout_s``)."""
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return json.loads(out.read_text())["rows"] if out.exists() else []


def probe_summary(rows: list[list[Any]]) -> dict[str, Any]:
    """p50/p90/p99 of the answered rejections' latency (ms), all and by path."""

    def pct(ms: list[float]) -> dict[str, Any]:
        if not ms:
            return {"n": 0, "p50": None, "p90": None, "p99": None}
        ms = sorted(ms)
        q = {k: ms[min(len(ms) - 1, round(k / 100 * (len(ms) - 1)))] for k in (50, 90, 99)}
        return {"n": len(ms), **{f"p{k}": round(v, 3) for k, v in q.items()}}

    rejected = [r for r in rows if r[1] is not None and r[3] is not None]
    return {
        "sent": len(rows),
        "rejected": len(rejected),
        "other": len(rows) - len(rejected),
        "by_reason": {k: sum(1 for r in rejected if r[3] == k) for k in {r[3] for r in rejected}},
        "all": pct([r[1] for r in rejected]),
        "hopeless": pct([r[1] for r in rejected if r[4]]),
        "full": pct([r[1] for r in rejected if not r[4]]),
    }


def format_result(res: dict[str, Any]) -> str:
    lines = [
        f"rejection path, us (median over {res['reps']} reps of {res['requests']} requests; "
        f"p50 / p99), encoder exact: {res['encoder_exact']}"
    ]
    for kind, r in res["kinds"].items():
        lines.append(f"{kind}: {r['path']}, {r['body_bytes']} B, {r['prompt_tokens']} tokens")
        for name in ("full", "hopeless", "handler_full", "handler_hopeless"):
            stages = ", ".join(f"{k} {v['p50']:.0f}/{v['p99']:.0f}" for k, v in r[name].items())
            lines.append(f"  {name:17} {stages}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rejection_path", description=__doc__)
    p.add_argument("--requests", type=int, default=200, help="requests per repetition and kind")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--model-dir", default=None, help="engine-exact tokens (default: approximate)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--live", metavar="URL", help="probe a running gateway instead")
    p.add_argument("--seconds", type=float, default=30.0, help="--live: how long")
    p.add_argument("--every-ms", type=float, default=100.0, help="--live: send period")
    args = p.parse_args(argv)
    if min(args.requests, args.reps, args.tokens) < 1 or args.seconds <= 0:
        p.error("--requests, --reps and --tokens must be >= 1, --seconds > 0")
    if args.live:
        res = live_probe(args.live, args.seconds, args.every_ms, args.tokens)
        res["summary"] = probe_summary(res["rows"])
        print(json.dumps(res["summary"]))
    else:
        res = asyncio.run(run(args.requests, args.reps, args.tokens, args.model_dir))
        print(format_result(res))
    res["command"] = "python -m bench.rejection_path " + " ".join(argv or sys.argv[1:])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
