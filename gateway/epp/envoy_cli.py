"""`kvgate envoy-config`: the Envoy config for the fleet in a kvgate config, steered by
`kvgate epp` (gateway/epp/envoy.py writes it; the real-Envoy tests run the same function).

The engines cluster lists the fleet's endpoints (decode instances' sidecars, colocated
engines), one request per connection when llama.cpp engines are among them. In Kubernetes the
InferencePool's endpoints replace the static list (docs/epp.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="kvgate TOML config (the fleet)")
    for flag, default, what in (
        ("--epp", ("127.0.0.1", 9002), "where `kvgate epp` serves ext_proc"),
        ("--listen", ("0.0.0.0", 8081), "Envoy's listener for clients"),
    ):
        where = f"{what} (default {default[0]}:{default[1]})"
        p.add_argument(flag, type=_host_port, default=default, metavar="HOST:PORT", help=where)
    p.add_argument(
        "--fail-open",
        action="store_true",
        help="requests go round robin when the picker is away (buffered request bodies); "
        "default fail-closed, GIE's duplex mode",
    )
    p.add_argument(
        "--fallbacks",
        type=int,
        default=1,
        help="Envoy's retries over the picker's fallback endpoints (as `kvgate epp "
        "--fallbacks`; default 1)",
    )
    p.add_argument(
        "--engine-idle-s",
        type=float,
        default=4.0,
        help="close an idle engine connection after this long: below the engines' own "
        "keep-alive (uvicorn's and llama-server's 5 s; default 4)",
    )
    p.add_argument("--admin-port", type=int, help="Envoy's admin interface on 127.0.0.1:PORT")
    p.add_argument("--out", type=Path, help="write here (default: standard output)")


def main(args: argparse.Namespace) -> int:
    from config.settings import EngineKind, Role
    from gateway.epp.cli import load_for_envoy

    try:
        from gateway.epp.envoy import envoy_config, fleet_endpoints
    except ImportError as exc:  # xds-protos: the picker's protocol names come from it
        print(f"kvgate envoy-config: needs the epp extra (pip install 'kvgate[epp]'): {exc}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.fallbacks < 0 or not args.engine_idle_s > 0:
        print(
            "kvgate envoy-config: --fallbacks must be >= 0 and --engine-idle-s > 0",
            file=sys.stderr,
        )
        return 2
    settings = load_for_envoy(args.config, "kvgate envoy-config")
    if settings is None:
        return 2
    try:
        engines, per_connection = fleet_endpoints(settings)
    except OSError as exc:  # a host name that does not resolve
        print(f"kvgate envoy-config: {args.config}: engine address: {exc}", file=sys.stderr)
        return 2
    guessed = [
        i.id
        for i in settings.instances()
        if i.engine is EngineKind.AUTO and i.role is not Role.PREFILL  # Envoy's endpoints
    ]
    if guessed and per_connection is None:
        # The kind is learnt from /metrics at run time, too late for a static Envoy config.
        print(
            f'kvgate envoy-config: note: engine = "auto" for {", ".join(guessed)}; declare '
            'engine = "llamacpp" for llama-servers: Envoy must then take one request per '
            "connection (docs/epp.md)",
            file=sys.stderr,
        )
    config = envoy_config(
        listen=args.listen,
        epp=args.epp,
        engines=engines,
        fail_open=args.fail_open,
        admin_port=args.admin_port,
        retries=max(1, args.fallbacks),
        upstream_idle_s=args.engine_idle_s,
        requests_per_connection=per_connection,
    )
    text = json.dumps(config, indent=2) + "\n"  # Envoy reads JSON as it reads YAML
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        args.out.write_text(text)
    except OSError as exc:
        print(f"kvgate envoy-config: {args.out}: {exc}", file=sys.stderr)
        return 2
    print(f"kvgate envoy-config: {len(engines)} engine endpoints -> {args.out}", file=sys.stderr)
    return 0
