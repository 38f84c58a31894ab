"""The `kvgate` command line. Subcommands import their modules lazily so each starts fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def _config_check(args: argparse.Namespace) -> int:
    from backends.profile_file import ProfileFileError, load_measured_profiles
    from config.loader import ConfigError, load_settings, settings_to_dict
    from routing.policies.registry import PolicyError, build_policy

    try:
        settings = load_settings(args.file)
        build_policy(settings.routing.policy, settings.routing.params)
        load_measured_profiles(settings.predictors)  # predictors.profile_file(s), if set
    except ConfigError as exc:
        print(f"kvgate: {exc}", file=sys.stderr)
        return 2
    except (PolicyError, ProfileFileError) as exc:
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
    from bench.decision import main

    return main(args)


def _sim(args: argparse.Namespace) -> int:
    from replay.sim_cli import main

    return main(args)


def _sim_sweep(args: argparse.Namespace) -> int:
    from replay.sweep import main

    return main(args)


def _sim_cache(args: argparse.Namespace) -> int:
    from replay.cache_analysis import main

    return main(args)


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import main

    return main(args)


def _emulate(args: argparse.Namespace) -> int:
    from replay.emulator.cli import main

    return main(args)


def _demo(args: argparse.Namespace) -> int:
    from replay.demo import main

    return main(args)


def _profile(args: argparse.Namespace) -> int:
    from backends.profile_cli import main

    return main(args)


def _replay(args: argparse.Namespace) -> int:
    from replay.loadgen import main

    return main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware admission and routing gateway for LLM inference fleets.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="run a small fleet on loopback and replay a trace slice")
    from replay.demo import add_arguments as add_demo_args

    add_demo_args(demo)
    demo.set_defaults(func=_demo)

    replay_p = sub.add_parser("replay", help="open-loop live load from a trace against a gateway")
    from replay.loadgen import add_arguments as add_replay_args

    add_replay_args(replay_p)
    replay_p.set_defaults(func=_replay)

    serve = sub.add_parser("serve", help="run the gateway (OpenAI-compatible reverse proxy)")
    from gateway.serve import add_arguments as add_serve_args

    add_serve_args(serve)
    serve.set_defaults(func=_serve)

    emulate = sub.add_parser("emulate", help="run an engine emulator (vLLM/SGLang on the wire)")
    from replay.emulator.cli import add_arguments as add_emulate_args

    add_emulate_args(emulate)
    emulate.set_defaults(func=_emulate)

    profile = sub.add_parser(
        "profile", help="measure a live engine and write a predictor profile for it"
    )
    from backends.profile_cli import add_arguments as add_profile_args

    add_profile_args(profile)
    profile.set_defaults(func=_profile)

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
    from bench.decision import add_arguments as add_decision_args

    add_decision_args(decision)
    decision.set_defaults(func=_bench_decision)

    sim = sub.add_parser(
        "sim",
        help="replay a trace through a simulated fleet (see also: kvgate sim cache TRACE)",
        description="Replay a trace through a simulated fleet running kvgate's Conductor. "
        "`kvgate sim cache TRACE` runs the prefix-cache hit-ratio analysis instead.",
    )
    from replay.sim_cli import add_arguments as add_sim_args

    add_sim_args(sim)
    sim.set_defaults(func=_sim)

    preds = sub.add_parser("predictors", help="train and evaluate the latency predictors")
    from predictors.cli import add_arguments as add_predictor_args

    add_predictor_args(preds.add_subparsers(dest="predictors_command", metavar="ACTION"))
    return parser


# `kvgate sim NAME ...`: module (with add_arguments), description, handler
_SIM_SIBLINGS = {
    "cache": (
        "replay.cache_analysis",
        "Prefix-cache hit ratio of a trace per capacity and eviction policy (Mooncake Table 1).",
        _sim_cache,
    ),
    "sweep": (
        "replay.sweep",
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
        parser = build_parser()
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
