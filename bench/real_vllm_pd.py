"""TTFT of kvgate's vLLM P/D (NixlConnector) against a colocated vLLM, on real engines.

Three set-ups, one after the other (never more than two engines at once), each sent the same
number of cold prompts (a unique salt in front of a fixed ~500-token text) one at a time as
streamed completions, TTFT taken by the client at the first token event:

- ``pd_kvgate``: kvgate (``kvgate serve``, kv_connector "nixl") in front of a prefill + decode
  pair joined by vLLM's NixlConnector (UCX over TCP on loopback);
- ``pd_epp``: the same pair behind a real Envoy steered by ``kvgate epp``, with
  ``kvgate pd-sidecar`` in front of the decode engine (docs/epp.md; skipped without an envoy
  binary);
- ``pd_direct``: the same pair, the client running both legs itself (the protocol's own cost);
- ``colocated_direct``: one plain vLLM, the client talking to it directly;
- ``colocated_kvgate``: the same vLLM behind kvgate (the gateway's own share of the difference).

The first ``--warmup`` requests of each set-up are left out of the medians (the first P/D
request includes the NIXL handshake) and reported on their own. Every process started here is
ended by PID.

    python -m bench.real_vllm_pd --requests 20 --json out/real-vllm-pd.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from gateway.epp.envoy import find_envoy
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine
from tests.real.pd_harness import KvgateProcess, start_nixl_pair

TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 10


async def _one(
    session: aiohttp.ClientSession, url: str, max_tokens: int, prefill_url: str | None
) -> tuple[float, float, int]:
    """(TTFT s, prefill leg s, prompt tokens) of one cold streamed completion. With
    ``prefill_url`` the client runs the NIXL prefill leg itself first (P/D without kvgate)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": f"[{uuid.uuid4().hex}] {TEXT}",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    prefill_s = 0.0
    if prefill_url is not None:
        leg = {**body, "stream": False, "max_tokens": 1}
        leg.pop("stream_options")
        leg["kv_transfer_params"] = {"do_remote_decode": True}
        async with session.post(f"{prefill_url}/v1/completions", json=leg) as resp:
            body["kv_transfer_params"] = (await resp.json())["kv_transfer_params"]
        prefill_s = time.perf_counter() - t0
    first: float | None = None
    prompt_tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.read())[:300]!r}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if first is None and event.get("choices"):
                first = time.perf_counter()
            if event.get("usage"):
                prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
    if first is None:
        raise RuntimeError(f"{url}: no token in the answer")
    return first - t0, prefill_s, prompt_tokens


async def measure(
    url: str, n: int, warmup: int, max_tokens: int, prefill_url: str | None = None
) -> dict[str, Any]:
    ttfts: list[float] = []
    prefills: list[float] = []
    prompt_tokens: list[int] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(warmup + n):
            ttft, prefill_s, tokens = await _one(session, url, max_tokens, prefill_url)
            ttfts.append(ttft)
            prefills.append(prefill_s)
            prompt_tokens.append(tokens)
    timed = ttfts[warmup:]
    out = {
        "requests": n,
        "prompt_tokens_median": statistics.median(prompt_tokens),
        "ttft_median_ms": round(statistics.median(timed) * 1000, 1),
        "ttft_p90_ms": round(sorted(timed)[int(0.9 * (len(timed) - 1))] * 1000, 1),
        "ttft_min_ms": round(min(timed) * 1000, 1),
        "warmup_ttft_ms": [round(t * 1000, 1) for t in ttfts[:warmup]],
    }
    if prefill_url is not None:
        out["prefill_leg_median_ms"] = round(statistics.median(prefills[warmup:]) * 1000, 1)
    return out


def _config(port: int, pools: str) -> str:
    return (
        # Checks 10 s apart: three 2 s health timeouts in a row (a decode engine starved of CPU
        # on a loaded 2-core host) would otherwise eject the only decode instance mid-run.
        f'[server]\nhost = "127.0.0.1"\nport = {port}\nrefit_interval_s = 0\n'
        "health_interval_s = 10\n"
        '[admission]\nmode = "none"\n[replication]\nenabled = false\n'
        "[routing]\nblock_size = 32\n" + pools
    )


def _pd_pools(prefill: EngineProcess, decode: EngineProcess) -> str:
    return (
        '[[pools]]\nname = "prefill"\nrole = "prefill"\nkv_connector = "nixl"\n'
        f'[[pools.instances]]\nid = "p0"\nurl = "{prefill.url}"\n'
        '[[pools]]\nname = "decode"\nrole = "decode"\nkv_connector = "nixl"\n'
        f'[[pools.instances]]\nid = "d0"\nurl = "{decode.url}"\n'
    )


def _colocated_pools(engine: EngineProcess) -> str:
    return (
        '[[pools]]\nname = "workers"\nrole = "both"\n'
        f'[[pools.instances]]\nid = "c0"\nurl = "{engine.url}"\n'
    )


def _external_kv_tokens(engine: EngineProcess) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total") and (
                'source="external_kv_transfer"' in line
            ):
                return float(line.rpartition(" ")[2])
    return 0.0


def _through_envoy(
    args: argparse.Namespace, tmp: Path, prefill: EngineProcess, decode: EngineProcess
) -> dict[str, Any]:
    from config.settings import AdmissionMode, InstanceSettings, KVConnector, Role, Settings
    from gateway.epp.stack import EppStackSpec
    from tests.gateway.epp.envoy_stack import envoy_stack

    base = Settings()
    nixl = KVConnector.NIXL
    spec = EppStackSpec(
        instances=(
            InstanceSettings("p0", prefill.url, Role.PREFILL, kv_connector=nixl),
            InstanceSettings("d0", decode.url, Role.DECODE, kv_connector=nixl),
        ),
        base=replace(base, admission=replace(base.admission, mode=AdmissionMode.NONE)),
        block_size=32,
        kv_events=False,
        health_interval_s=10.0,  # as _config: a busy engine's late /health must not eject it
        workdir=tmp / "epp",
    )
    with envoy_stack(spec) as ts:
        before = _external_kv_tokens(decode)
        out = asyncio.run(measure(ts.url, args.requests, args.warmup, args.max_tokens))
        out["decode_external_kv_tokens"] = _external_kv_tokens(decode) - before
    return out


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    p_port, d_port, gw_port = free_ports(3, lo=args.port_base, hi=args.port_base + 40)
    side = free_ports(2, lo=args.port_base + 50, hi=args.port_base + 100)
    prefill, decode = start_nixl_pair([p_port, d_port], side)
    try:
        gw = KvgateProcess(tmp, "pd", gw_port, _config(gw_port, _pd_pools(prefill, decode)))
        try:
            before = _external_kv_tokens(decode)
            results["pd_kvgate"] = asyncio.run(
                measure(gw.url, args.requests, args.warmup, args.max_tokens)
            )
            results["pd_kvgate"]["decode_external_kv_tokens"] = _external_kv_tokens(decode) - before
        except Exception:
            print(f"kvgate log tail:\n{gw.log_tail()}", file=sys.stderr)
            raise
        finally:
            gw.stop()
        if find_envoy() is not None:
            results["pd_epp"] = _through_envoy(args, tmp, prefill, decode)
        results["pd_direct"] = asyncio.run(
            measure(decode.url, args.requests, args.warmup, args.max_tokens, prefill.url)
        )
    finally:
        stop_engine(decode)
        stop_engine(prefill)
    engine = start_vllm(p_port)
    try:
        results["colocated_direct"] = asyncio.run(
            measure(engine.url, args.requests, args.warmup, args.max_tokens)
        )
        gw = KvgateProcess(tmp, "colocated", gw_port, _config(gw_port, _colocated_pools(engine)))
        try:
            results["colocated_kvgate"] = asyncio.run(
                measure(gw.url, args.requests, args.warmup, args.max_tokens)
            )
        except Exception:
            print(f"kvgate log tail:\n{gw.log_tail()}", file=sys.stderr)
            raise
        finally:
            gw.stop()
    finally:
        stop_engine(engine)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=20, help="timed requests per set-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests first")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port-base", type=int, default=18400, help="ports used: base .. base+100")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvgate-pd-bench-") as tmp:
        results = run(args, Path(tmp))
    for name, r in results.items():
        print(
            f"{name:18s} TTFT median {r['ttft_median_ms']:7.1f} ms  p90 {r['ttft_p90_ms']:7.1f} ms"
            f"  min {r['ttft_min_ms']:7.1f} ms  prompt {r['prompt_tokens_median']:.0f} tok"
            f"  warm-up {r['warmup_ttft_ms']}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
