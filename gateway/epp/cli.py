"""`kvgate epp`: run kvgate as Envoy's endpoint picker (ext_proc gRPC), docs/epp.md.

Options come from the command line for now (a ``[epp]`` config section would hold them);
the fleet, SLOs, policy and admission come from the same TOML config as `kvgate serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from config.settings import PDProtocol, Role, Settings

log = logging.getLogger("kvgate.epp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="kvgate TOML config (pools, SLOs, policy)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9002, help="ext_proc gRPC port (default 9002)")
    p.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="also serve gRPC health on this port (default: only on the ext_proc port)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus /metrics, /books (in-flight counts) and the admin API "
        "(/admin/*, with server.admin_token) on this HTTP port",
    )
    p.add_argument(
        "--fallbacks",
        type=int,
        default=1,
        help="fallback endpoints after the pick, for Envoy's override_host policy (0: none, "
        "for an ORIGINAL_DST cluster, which takes one endpoint)",
    )
    p.add_argument(
        "--message-timeout-s",
        type=float,
        default=10.0,
        help="Envoy's ext_proc message_timeout, which a pick keeps to (default 10)",
    )
    p.add_argument(
        "--max-message-timeout-s",
        type=float,
        default=120.0,
        help="Envoy's ext_proc max_message_timeout (default 120, as the generated config): a "
        "request turned away on its TBT check waits for decode room at most this minus "
        "--message-timeout-s, Envoy's timer extended meanwhile; 0: no waiting behind Envoy",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def check_supported(settings) -> str | None:
    """Why this config cannot run behind Envoy, or None. P/D pools need a sidecar in front
    of every decode instance (``sidecar_url``: `kvgate pd-sidecar` or llm-d's pd-sidecar),
    and vLLM's protocol (the sidecars speak vLLM's KV connectors, not SGLang's bootstrap).
    llama.cpp slot files need kvgate on the request path (a file is loaded before the request
    goes out), which Envoy is."""
    if settings.routing.llamacpp_slot_save_path is not None:
        return (
            "routing.llamacpp_slot_save_path: llama.cpp slot files are loaded by kvgate before "
            "it forwards a request, and behind Envoy kvgate does not forward; use `kvgate serve`"
        )
    for inst in settings.instances():
        if inst.role is Role.DECODE and inst.sidecar_url is None:
            return (
                f"decode instance {inst.id!r} has no sidecar_url: behind Envoy a P/D request "
                "goes to its decode instance's sidecar (`kvgate pd-sidecar`), docs/epp.md"
            )
        if inst.role is not Role.BOTH and inst.protocol is not PDProtocol.VLLM:
            return (
                f"instance {inst.id!r}: P/D behind Envoy speaks vLLM's KV connectors only "
                f'(protocol "{inst.protocol}"); use `kvgate serve` for SGLang P/D'
            )
    return None


def load_for_envoy(path: str, prog: str) -> Settings | None:
    """The config at ``path`` if it loads and can run behind Envoy (``check_supported``);
    else None, once ``prog`` has said why on stderr."""
    from config.loader import ConfigError, load_settings
    from routing.policies.registry import PolicyError

    try:
        settings = load_settings(path)
    except (ConfigError, PolicyError, OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    why = check_supported(settings)
    if why is not None:
        print(f"{prog}: {path}: {why}", file=sys.stderr)
        return None
    return settings


async def _run(args: argparse.Namespace, settings) -> int:
    from gateway.epp.server import run_until_signal, start_epp
    from gateway.runtime import Gateway

    gw = Gateway(settings)
    gw.config_path = args.config
    epp = await start_epp(
        gw,
        host=args.host,
        port=args.port,
        health_port=args.health_port,
        metrics_port=args.metrics_port,
        fallbacks=args.fallbacks,
        timeouts=args.timeouts,
    )
    n = len(settings.instances())
    extra = f", metrics on :{epp.metrics_port}" if epp.metrics_port else ""
    print(
        f"kvgate epp: picking among {n} instances on grpc://{args.host}:{epp.port} "
        f"(policy {settings.routing.policy}, admission {settings.admission.mode}{extra})",
        file=sys.stderr,
        flush=True,
    )
    await run_until_signal(epp, settings.server.drain_timeout_s)
    return 0


def main(args: argparse.Namespace) -> int:
    from routing.policies.registry import PolicyError

    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError as exc:
        print(
            f"kvgate epp: needs the epp extra (pip install 'kvgate[epp]'): {exc}", file=sys.stderr
        )
        return 2
    if args.fallbacks < 0:
        print("kvgate epp: --fallbacks must be >= 0", file=sys.stderr)
        return 2
    from gateway.epp.protocol import MessageTimeouts

    try:
        args.timeouts = MessageTimeouts(args.message_timeout_s, args.max_message_timeout_s)
    except ValueError as exc:
        print(f"kvgate epp: --message-timeout-s / --max-message-timeout-s: {exc}", file=sys.stderr)
        return 2
    settings = load_for_envoy(args.config, "kvgate epp")
    if settings is None:
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from gateway.gc_tuning import tune_gc

    tune_gc()
    try:
        # asyncio's own loop: grpc.aio supports it (uvloop measured no better here)
        return asyncio.run(_run(args, settings))
    except (PolicyError, OSError, ValueError) as exc:
        print(f"kvgate epp: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
