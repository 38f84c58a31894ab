"""Load for the proxy benchmark: wrk with a chat-completions lua script, output parsing, and a
small keep-alive streaming client for time to first token."""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

CHAT_PATH = "/v1/chat/completions"

# ~1 KB chat bodies: a shared ~800-character system prompt and a user turn of their own; 256
# of them cycled, or (unique) a new one for every request, numbered from an offset the run
# gives (so no two runs repeat a turn). Arguments after `--`: stream (0|1), max_tokens,
# unique (0|1) and the offset.
CHAT_LUA = r"""
local bodies = {}
local n = 256
local idx = 0
local unique = false
local stream, max_tokens = "false", 16
local system = string.rep("You are a careful assistant for a retail bank. Answer briefly. ", 13)

local function body(i)
  local user = string.format(
    "Request %05d: summarise account activity for customer %d in region %d, " ..
    "list the three largest transactions, and flag anything unusual. ", i, i * 7919, i % 17)
  user = user .. string.rep(string.format("ctx%03d ", i % 1000), 8)
  return string.format(
    '{"model":"stub-model","messages":[{"role":"system","content":"%s"},' ..
    '{"role":"user","content":"%s"}],"max_tokens":%d,"stream":%s}',
    system, user, max_tokens, stream)
end

function init(args)
  stream = (args[1] == "1") and "true" or "false"
  max_tokens = tonumber(args[2] or "16")
  unique = (args[3] == "1")
  idx = tonumber(args[4] or "0")
  if not unique then
    for i = 1, n do bodies[i] = body(i) end
    idx = 0
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  if unique then
    idx = idx + 1
    return wrk.format(nil, nil, nil, body(idx))
  end
  idx = idx % n + 1
  return wrk.format(nil, nil, nil, bodies[idx])
end
"""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def write_lua(directory: Path) -> Path:
    path = directory / "chat.lua"
    path.write_text(CHAT_LUA)
    return path


def wrk_path() -> str | None:
    return shutil.which("wrk")


def ensure_wrk() -> str:
    """wrk from Debian's packages when it is missing (we are root on the bench machine)."""
    found = wrk_path()
    if found:
        return found
    subprocess.run(["apt-get", "update", "-qq"], check=False, timeout=300)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=False, timeout=300)
    found = wrk_path()
    if not found:
        raise RuntimeError("wrk is not installed and apt-get could not install it")
    return found


def _ms(value: str, unit: str) -> float:
    return float(value) * _UNITS[unit]


def parse_wrk(out: str) -> dict:
    """Requests/s, completed requests, latency percentiles (ms) and errors from wrk --latency."""
    res: dict = {"requests": 0, "rps": 0.0, "errors": 0, "non_2xx": 0}
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m:
        res["requests"] = int(m.group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        res["rps"] = float(m.group(1))
    for pct, key in (("50", "p50_ms"), ("75", "p75_ms"), ("90", "p90_ms"), ("99", "p99_ms")):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
        res[key] = _ms(m.group(1), m.group(2)) if m else None
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if m:
        res["non_2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if m:
        res["errors"] = sum(int(g) for g in m.groups())
    return res


def run_wrk(
    wrk: str,
    lua: Path,
    url: str,
    c: int,
    duration_s: float,
    stream: bool,
    tokens: int,
    unique_from: int | None = None,
) -> dict:
    """One bounded wrk run (one thread, c keep-alive connections); ``unique_from``: a new user
    turn for every request, numbered from there (None: 256 bodies cycled)."""
    cmd = [
        wrk,
        "-t1",
        f"-c{c}",
        f"-d{max(1, round(duration_s))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(lua),
        url,
        "--",
        "1" if stream else "0",
        str(tokens),
        "0" if unique_from is None else "1",
        str(unique_from or 0),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 30)
    res = parse_wrk(proc.stdout)
    if proc.returncode != 0 or not res["requests"]:
        res["wrk_error"] = (proc.stderr or proc.stdout)[-500:]
    return res


# ---------------------------------------------------------------- TTFT on a keep-alive connection
def _chat_request(host: str, port: int, i: int, tokens: int) -> bytes:
    body = (
        '{"model":"stub-model","messages":[{"role":"system","content":"You are terse."},'
        f'{{"role":"user","content":"ttft probe {i:05d} "}}],"max_tokens":{tokens},'
        '"stream":true}'
    ).encode()
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _ttft(url: str, n: int, tokens: int, timeout_s: float) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)  # sets TCP_NODELAY
    ttfts, totals, reads = [], [], []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            writer.write(_chat_request(host, port, i, tokens))
            first = None
            buf, nreads = b"", 0
            while not buf.endswith(b"0\r\n\r\n"):
                data = await asyncio.wait_for(reader.read(65536), timeout_s)
                if not data:
                    raise ConnectionError("connection closed mid-stream")
                nreads += 1
                buf += data
                if first is None and b"data:" in buf:
                    first = time.perf_counter()
            if not buf.startswith(b"HTTP/1.1 200"):
                raise ConnectionError(buf[:200].decode(errors="replace"))
            if first is None:
                raise ConnectionError("no SSE event in the answer")
            ttfts.append(first - t0)
            totals.append(time.perf_counter() - t0)
            reads.append(nreads)
    finally:
        writer.close()
    k = min(3, n - 1)  # the first requests warm the connection up
    return {
        "ttft_p50_ms": statistics.median(ttfts[k:]) * 1e3,
        "total_p50_ms": statistics.median(totals[k:]) * 1e3,
        "reads_p50": statistics.median(reads[k:]),
        "n": n,
    }


def measure_ttft(url: str, n: int = 30, tokens: int = 16, timeout_s: float = 10.0) -> dict:
    """Median time from sending a streaming chat request to the first SSE event, ``n``
    sequential requests on one keep-alive connection."""
    try:
        return asyncio.run(asyncio.wait_for(_ttft(url, n, tokens, timeout_s), n * timeout_s))
    except (OSError, TimeoutError, ConnectionError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
