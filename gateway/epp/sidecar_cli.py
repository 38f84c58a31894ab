"""`kvgate pd-sidecar`: run the P/D sidecar (gateway/epp/pd_sidecar.py) next to a decode
engine, and ``start_sidecar`` for stacks and tests that run it inside their own event loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from urllib.parse import urlsplit

from config.settings import KVConnector
from gateway.epp.pd_sidecar import PdSidecar
from gateway.serve import RunningServer, start_server


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode", required=True, help="the decode engine's base URL")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="listen port (default 8200)")
    p.add_argument(
        "--connector",
        choices=[c.value for c in KVConnector],
        default=KVConnector.NIXL.value,
        help="the engines' KV connector: nixl (the prefill returns kv_transfer_params for the "
        "decode) or shared_storage (a shared KV store; no params); default nixl",
    )
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="each leg's time limit (default 600)"
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


async def start_sidecar(
    app: PdSidecar, host: str = "127.0.0.1", port: int = 0, *, signals: bool = False
) -> RunningServer:
    """Serve ``app`` on ``host:port`` (0: an ephemeral port) until ``stop``."""
    return await start_server(app, host, port, lifespan="on", signals=signals)


def main(args: argparse.Namespace) -> int:
    parts = urlsplit(args.decode)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        msg = f"--decode must be an http(s) URL, got {args.decode!r}"
        print(f"kvgate pd-sidecar: {msg}", file=sys.stderr)
        return 2
    if args.timeout_s <= 0:
        print("kvgate pd-sidecar: --timeout-s must be > 0", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = PdSidecar(args.decode, KVConnector(args.connector), timeout_s=args.timeout_s)

    async def run() -> None:
        running = await start_sidecar(app, args.host, args.port, signals=True)
        print(
            f"kvgate pd-sidecar: {args.connector} P/D for {args.decode} on "
            f"http://{args.host}:{running.port}",
            file=sys.stderr,
            flush=True,
        )
        await running.task

    try:
        asyncio.run(run())
    except OSError as exc:
        print(f"kvgate pd-sidecar: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
