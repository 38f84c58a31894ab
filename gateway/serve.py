"""`kvgate serve`: run the gateway with uvicorn (uvloop + httptools when available)."""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="kvgate TOML config (pools, SLOs, policy)")
    p.add_argument("--host", help="listen address (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: server.port, 8000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from config.loader import ConfigError, load_settings
    from gateway.app import build_app
    from routing.policies.registry import PolicyError

    try:
        settings = load_settings(args.config)
        app = build_app(settings)
    except (ConfigError, PolicyError, OSError, ValueError) as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from gateway.runtime import tune_gc

    tune_gc()  # the process is this gateway's alone: tune the cyclic GC for it
    host = args.host or settings.server.host
    port = args.port or settings.server.port
    n = len(settings.instances())
    print(
        f"kvgate: serving {n} instances on http://{host}:{port} "
        f"(policy {settings.routing.policy}, admission {settings.admission.mode})",
        file=sys.stderr,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,  # this is the proxy: no X-Forwarded-* rewriting per request
        server_header=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return 0
