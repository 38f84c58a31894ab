"""The `kvgate` command line. Subcommands import their modules lazily so each starts fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def _config_check(args: argparse.Namespace) -> int:
    from backends.profile_file import ProfileFileError, load_measured_profiles
    from config.loader import ConfigError, load_settings, settings_to_dict

    try:
        settings = load_settings(args.file)  # the policy and its params included
        load_measured_profiles(settings.predictors)  # predictors.profile_file(s), if set
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    except ProfileFileError as exc:
        print(f"kvgate: {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.show:
        import json

        print(json.dumps(settings_to_dict(settings), indent=2))
    else:
        n = len(settings.instances())
        print(
            f"{args.file}: ok ({len(settings.pools)} pools, {n} instances, "
            f"policy {settings.routing.policy}, admission {settings.admission.mode})"
        )
    return 0


def _bench_decision(args: argparse.Namespace) -> int:
    from replay.sim.decision_latency import main

    return main(args)


def _sim(args: argparse.Namespace) -> int:
    from replay.sim.sim_cli import main

    return main(args)


def _sim_sweep(args: argparse.Namespace) -> int:
    from replay.sim.sweep import main

    return main(args)


def _sim_cache(args: argparse.Namespace) -> int:
    from replay.sim.cache_analysis import main

    return main(args)


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import main

    return main(args)


def _epp(args: argparse.Namespace) -> int:
    from gateway.epp.cli import main

    return main(args)


def _envoy_config(args: argparse.Namespace) -> int:
    from gateway.epp.envoy_cli import main

    return main(args)


def _pd_sidecar(args: argparse.Namespace) -> int:
    from gateway.epp.sidecar_cli import main

    return main(args)


def _emulate(args: argparse.Namespace) -> int:
    from replay.emulator.cli import main

    return main(args)


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import main

    return main(args)


def _profile(args: argparse.Namespace) -> int:
    from backends.profile_cli import main

    return main(args)


def _replay(args: argparse.Namespace) -> int:
    from replay.live.loadgen import main

    return main(args)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line. ``only`` names the one subcommand whose arguments are built (the one
    being run: the others' modules, some importing numpy and lightgbm, stay unimported);
    ``""`` builds none (``kvgate --help``), None all of them."""

    def wanted(name: str) -> bool:
        return only is None or only == name

    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware admission and routing gateway for LLM inference fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    simple = [
        ("demo", "run a small fleet on loopback and replay a trace slice", "gateway.demo", _demo),
        (
            "replay",
            "open-loop live load from a trace against a gateway",
            "replay.live.loadgen",
            _replay,
        ),
        ("serve", "run the gateway (OpenAI-compatible reverse proxy)", "gateway.serve", _serve),
        (
            "epp",
            "run the gateway as Envoy's endpoint picker (ext_proc gRPC, Gateway API Inference "
            "Extension)",
            "gateway.epp.cli",
            _epp,
        ),
        (
            "envoy-config",
            "write the Envoy config for a kvgate config's fleet, steered by `kvgate epp`",
            "gateway.epp.envoy_cli",
            _envoy_config,
        ),
        (
            "pd-sidecar",
            "run the P/D sidecar in front of a decode engine (behind Envoy and `kvgate epp`)",
            "gateway.epp.sidecar_cli",
            _pd_sidecar,
        ),
        (
            "emulate",
            "run an engine emulator (vLLM/SGLang on the wire)",
            "replay.emulator.cli",
            _emulate,
        ),
        (
            "profile",
            "measure a live engine and write a predictor profile for it",
            "backends.profile_cli",
            _profile,
        ),
    ]
    for name, help_text, module, func in simple:
        p = sub.add_parser(name, help=help_text)
        if wanted(name):
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(func=func)

    cfg = sub.add_parser("config", help="check or show a configuration file")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION")
    cfg_sub.required = True
    check = cfg_sub.add_parser("check", help="validate a TOML config (exit 2 on errors)")
    check.add_argument("file", help="path to a kvgate TOML config")
    check.add_argument("--show", action="store_true", help="print the resolved settings")
    check.set_defaults(func=_config_check)

    bench = sub.add_parser("bench", help="micro-benchmarks with JSON output")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench_sub.required = True
    decision = bench_sub.add_parser(
        "decision", help="latency of one scheduling decision on a warmed state"
    )
    if wanted("bench"):
        importlib.import_module("replay.sim.decision_latency").add_arguments(decision)
    decision.set_defaults(func=_bench_decision)

    sim = sub.add_parser(
        "sim",
        help="replay a trace through a simulated fleet (see also: kvgate sim cache|sweep TRACE)",
        description="Replay a trace through a simulated fleet running kvgate's Conductor. "
        "`kvgate sim cache TRACE` runs the prefix-cache hit-ratio analysis instead, "
        "`kvgate sim sweep TRACE` a grid of loads and TTFT SLOs with the goodput upper bound.",
    )
    if wanted("sim"):
        importlib.import_module("replay.sim.sim_cli").add_arguments(sim)
    sim.set_defaults(func=_sim)

    preds = sub.add_parser("predictors", help="train and evaluate the latency predictors")
    if wanted("predictors"):
        actions = preds.add_subparsers(dest="predictors_command", metavar="ACTION")
        importlib.import_module("backends.predictors_cli").add_arguments(actions)
    return parser


# `kvgate sim NAME ...`: module (with add_arguments), description, handler
_SIM_SIBLINGS = {
    "cache": (
        "replay.sim.cache_analysis",
        "Prefix-cache hit ratio of a trace per capacity and eviction policy (Mooncake Table 1).",
        _sim_cache,
    ),
    "sweep": (
        "replay.sim.sweep",
        "Goodput, p90 TTFT and wasted prefills of each --compare entry over --speeds x "
        "--ttft-slos, next to the goodput upper bound (JSON + PNG).",
        _sim_sweep,
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sibling = _SIM_SIBLINGS.get(argv[1]) if argv[:1] == ["sim"] and len(argv) > 1 else None
    if sibling is not None:  # `kvgate sim cache|sweep TRACE`: siblings of `sim TRACE`
        module, description, func = sibling
        parser = argparse.ArgumentParser(prog=f"kvgate sim {argv[1]}", description=description)
        importlib.import_module(module).add_arguments(parser)
        parser.set_defaults(func=func)
        argv = argv[2:]
    else:
        command = next((a for a in argv if not a.startswith("-")), "")
        parser = build_parser(command)
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
