"""`kvgate sim`: replay a trace through a simulated fleet, one policy or several side by side."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from config.settings import (
    AdmissionMode,
    DecodePlacement,
    PredictorSettings,
    Settings,
    SLOSettings,
    frozen_mapping,
)
from replay.engine.network import NETWORK_MODELS
from replay.report.progress import ProgressBar
from replay.report.results import RunResult
from replay.sim.fleet import FleetSpec
from replay.sim.run_specs import RunSpec, parse_run_specs, with_spec
from replay.workload.traces import TraceRequest, load_trace, select

if TYPE_CHECKING:
    from replay.sim.options import SimOptions

_SYNTHETIC = {"synthetic:chat"}


def load_workload(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace in _SYNTHETIC:
        from replay.workload.synthetic import chat_spec, generate

        trace = generate(chat_spec(requests=args.limit or 2000, seed=args.seed))
    else:
        trace = load_trace(args.trace)
    return select(
        trace,
        speed=args.speed,
        start_s=args.start,
        duration_s=args.duration,
        sample=args.sample,
        limit=args.limit,
        seed=args.seed,
    )


# ``--best-effort on|off`` and the like: (admission section, its switch, the choice for True).
_ADMISSION_SWITCHES = (
    ("best_effort", "enabled", "on"),
    ("doomed_warmup", "enabled", "on"),
    ("decode_reservation", "enabled", "on"),
    ("decode_queue", "enabled", "on"),
    ("tbt_headroom", "adaptive", "learned"),
    ("prefill_stall", "enabled", "on"),
)


def base_settings(args: argparse.Namespace) -> Settings:
    if args.config:
        from config.loader import load_settings

        settings = load_settings(args.config)
    else:
        # The Mooncake papers' setting: LLaMA2-70B on 8xA100 per instance.
        settings = Settings(
            slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
            predictors=PredictorSettings(profile="llama2-70b-a100-tp8"),
        )
    slo = settings.slo
    if args.ttft_slo is not None:
        slo = replace(slo, ttft_s=args.ttft_slo)
    if args.tbt_slo is not None:
        slo = replace(slo, tbt_s=args.tbt_slo)
    # Mooncake trace hash ids name 512-token blocks; the cache view must use the same size.
    routing = replace(settings.routing, block_size=args.block_size, seed=args.seed)
    if args.decode_placement:
        routing = replace(routing, decode_placement=DecodePlacement(args.decode_placement))
    if getattr(args, "param", None):
        params = {**routing.params, **parse_params(args.param)}
        routing = replace(routing, params=frozen_mapping(params))
    replication = replace(settings.replication, enabled=args.replication == "on")
    admission = settings.admission
    for section, field_name, on in _ADMISSION_SWITCHES:
        if value := getattr(args, section, None):
            switched = replace(getattr(admission, section), **{field_name: value == on})
            admission = replace(admission, **{section: switched})
    if getattr(args, "decode_rebind", None):
        routing = replace(routing, decode_rebind=args.decode_rebind == "on")
    predictors = settings.predictors
    if getattr(args, "link_gbps", None) is not None:
        # Sets the Conductor's transfer predictor and the simulated network alike.
        predictors = replace(predictors, link_bandwidth_gbps=args.link_gbps)
    return replace(
        settings,
        slo=slo,
        routing=routing,
        replication=replication,
        predictors=predictors,
        admission=admission,
    )


def parse_params(items: list[str]) -> dict[str, object]:
    """``--param macro_size=4 --param max_window_s=1.0``: policy parameters; values are
    parsed as int, float or bool when they look like one (the registry checks the types)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        value: object = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    continue
        out[key.strip()] = value
    return out


def fleet_from(args: argparse.Namespace, settings: Settings) -> FleetSpec:
    if args.colocated:
        counts = dict(prefill=0, decode=0, colocated=args.colocated)
    else:
        counts = dict(prefill=args.prefill, decode=args.decode, colocated=0)
    return FleetSpec(
        **counts,
        profile=args.profile or settings.predictors.profile,
        cache_capacity_tokens=args.cache_capacity_tokens,
        chunk_tokens=args.chunk_tokens,
        decode_local_check=not args.no_decode_check,
    )


def sim_options(args: argparse.Namespace) -> SimOptions:
    from replay.sim.options import SimOptions

    return SimOptions(ttft_after_transfer=args.ttft_after_transfer, network=args.network)


def run_one(
    settings: Settings,
    fleet: FleetSpec,
    trace: list[TraceRequest],
    spec: RunSpec,
    quiet: bool,
    options: SimOptions | None = None,
) -> RunResult:
    from replay.sim.simulator import Simulator

    s = with_spec(settings, spec)
    start = time.perf_counter()
    sim = Simulator(s, fleet, trace, options)
    result = sim.run(progress=ProgressBar(spec.label, enabled=not quiet))
    result.wall_s = time.perf_counter() - start
    result.extra["fleet"] = (
        f"{fleet.colocated} colocated" if fleet.colocated else f"{fleet.prefill}P+{fleet.decode}D"
    )
    result.extra["profile"] = fleet.profile
    result.extra["network"] = sim.options.network
    result.extra["sim_requests_per_wall_s"] = round(len(trace) / max(result.wall_s, 1e-9), 1)
    return result


def tuned_run(
    settings: Settings,
    fleet: FleetSpec,
    trace: list[TraceRequest],
    spec: RunSpec,
    quiet: bool,
    options: SimOptions | None = None,
) -> RunResult:
    """``--tune``: the peer's main threshold swept over PEER_TUNING's grid, as an operator
    would; the run with the best goodput wins (ties: the earlier, i.e. more permissive or
    shipped, setting). The label and ``extra["peer_setting"]`` name the winner."""
    from replay.report.report import summarize
    from routing.policies.peer_overload import PEER_TUNING

    key, values = PEER_TUNING[spec.policy]
    best: tuple[float, RunResult] | None = None
    for value in values:
        peer = replace(settings.admission.peer, **{key: value})
        s = replace(settings, admission=replace(settings.admission, peer=peer))
        result = run_one(s, fleet, trace, spec, quiet, options)
        goodput = summarize(result)["goodput_rps"] or 0.0
        if best is None or goodput > best[0]:
            best = (goodput, result)
        result.extra["peer_setting"] = f"{key}={value}"
    assert best is not None
    won = best[1]
    won.label = f"{spec.label}[{won.extra['peer_setting'].split('_', 1)[1]}]"
    won.extra["peer_tuned_over"] = ",".join(str(v) for v in values)
    return won


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake JSONL or CSV trace, or 'synthetic:chat'")
    p.add_argument("--config", help="kvgate TOML config (SLOs, policy parameters, predictors)")
    p.add_argument("--prefill", type=int, default=8, help="prefill instances (default 8)")
    p.add_argument("--decode", type=int, default=8, help="decode instances (default 8)")
    p.add_argument("--colocated", type=int, default=0, help="N colocated instances instead")
    p.add_argument("--profile", help="engine profile, e.g. llama2-70b-a100-tp8 (the default)")
    p.add_argument("--policy", default="kvcache_centric", help="placement policy")
    p.add_argument(
        "--admission",
        choices=[m.value for m in AdmissionMode],
        help="admission mode (default: the policy's native one)",
    )
    p.add_argument("--compare", help="comma list of policy[+admission] to run side by side")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed factor (2 = 2x load)")
    p.add_argument("--start", type=float, help="window start, seconds into the trace")
    p.add_argument("--duration", type=float, help="window length, seconds")
    p.add_argument("--sample", type=float, default=1.0, help="keep this fraction of requests")
    p.add_argument("--limit", type=int, help="at most this many requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO seconds (default 30)")
    p.add_argument("--tbt-slo", type=float, help="TBT SLO seconds (default 0.1)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per block (traces: 512)")
    p.add_argument(
        "--cache-capacity-tokens",
        type=int,
        help="prefix cache per prefill instance (default: the profile's KV capacity)",
    )
    p.add_argument("--chunk-tokens", type=int, help="chunked-prefill budget (default: off)")
    p.add_argument(
        "--no-decode-check",
        action="store_true",
        help="decode instances accept everything (no local TBT check)",
    )
    p.add_argument(
        "--decode-placement",
        choices=[m.value for m in DecodePlacement],
        help="decode load key: committed (default) or current (Mooncake's)",
    )
    p.add_argument(
        "--replication",
        choices=["on", "off"],
        default="on",
        help="proactive hot-prefix replication (default on)",
    )
    p.add_argument(
        "--best-effort",
        choices=["on", "off"],
        help="admission.best_effort.enabled: serve late, when the fleet is idle enough, a "
        "prompt that misses the TTFT SLO even on an idle instance (default: the config's, on)",
    )
    p.add_argument(
        "--doomed-warmup",
        choices=["on", "off"],
        help="admission.doomed_warmup.enabled: prefill, on an idle instance, the prompt of a "
        "request turned away as too long for the TTFT SLO, for the requests that share its "
        "prefix (default: the config's, on)",
    )
    p.add_argument(
        "--decode-queue",
        choices=["on", "off"],
        help="admission.decode_queue.enabled: a request turned away on its TBT check waits "
        "for decode room; each finished decode admits the waiting one with the shortest prompt "
        "that then fits (default: the config's, on)",
    )
    p.add_argument(
        "--decode-reservation",
        choices=["on", "off"],
        help="admission.decode_reservation.enabled: under decode overload, keep part of the "
        "TBT limit for shorter prompts (default: the config's, on)",
    )
    p.add_argument(
        "--tbt-headroom",
        choices=["learned", "fixed"],
        help="admission.tbt_headroom.adaptive: the share of the priority classes' TBT headroom "
        "in force learned from the decodes' outcomes, or the configured headroom always "
        "(default: the config's, learned)",
    )
    p.add_argument(
        "--prefill-stall",
        choices=["on", "off"],
        help="admission.prefill_stall.enabled: on a colocated instance, check the TBT that "
        "the request's prefill leaves to the decodes already there (default: the config's, on)",
    )
    p.add_argument(
        "--decode-rebind",
        choices=["on", "off"],
        help="routing.decode_rebind: move a decode whose instance can no longer take it "
        "within the TBT SLO when its prefill is done (default: the config's, on)",
    )
    p.add_argument(
        "--ttft-after-transfer",
        action="store_true",
        help="the client's first token comes from the decode instance, once its batch takes "
        "the request in after the KV transfer (the vLLM/SGLang P/D wire; transfer and join "
        "wait count in TTFT), instead of from the prefill at its end (Mooncake; the join wait "
        "then counts in the first gap between tokens)",
    )
    p.add_argument(
        "--network",
        choices=sorted(NETWORK_MODELS),
        default="calendar",
        help="how KV transfers share a NIC: 'calendar' sends one at a time per link direction, "
        "each in the earliest gap free on both ends (default; the model of every table in "
        "docs/); 'fair' splits each link's bandwidth among the transfers on it",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        help="network between instances in Gbit/s (KV transfers; default 200, RDMA-class)",
    )
    p.add_argument(
        "--param",
        action="append",
        metavar="KEY=VALUE",
        help="policy parameter (repeatable), e.g. --param macro_size=4",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="for each policy+peer: sweep the peer's main overload threshold and keep the "
        "setting with the best goodput (the label says which won)",
    )
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from config.errors import KvgateError
    from replay.report.report import format_table, summarize, write_json
    from routing.policies.registry import build_policy

    try:
        default_adm = AdmissionMode(args.admission) if args.admission else None
        specs = parse_run_specs(args.compare or args.policy, default_adm)
        settings = base_settings(args)
        for spec in specs:  # policy parameters are checked before any run starts
            build_policy(spec.policy, settings.routing.params)
        fleet = fleet_from(args, settings)
        fleet.validate()
        trace = load_workload(args)
        if not trace:
            raise ValueError("the selection left no requests")
        options = sim_options(args)
    except (KvgateError, ValueError, KeyError, OSError) as exc:  # KeyError: an unknown name
        print(f"kvgate sim: {exc}", file=sys.stderr)
        return 2
    results = [
        tuned_run(settings, fleet, trace, spec, args.quiet, options)
        if args.tune and spec.admission is AdmissionMode.PEER
        else run_one(settings, fleet, trace, spec, args.quiet, options)
        for spec in specs
    ]
    summaries = [summarize(r) for r in results]
    print(format_table(summaries))
    if args.json:
        write_json(Path(args.json), summaries, extra={"trace": args.trace, "speed": args.speed})
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plots:
        from replay.report.plots import write_plots

        for path in write_plots(results, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    return 0
