"""Does early admission earn its keep in front of real engines? Overload through kvgate, admission
on and off.

For each admission mode (``--modes``, default ``none,early``), in rounds whose order reverses
every other round: fresh real engines (llama.cpp ``llama-server`` or vLLM, one colocated pool,
started by the repo's harness, tests/real/engines.py), a fresh ``kvgate serve`` in front of them
with its predictors calibrated to the engine (``--profile FILE``, else measured once at the
start by ``kvgate profile`` against a fresh engine), then the same open-loop load
(bench.phase_load: token-id completions, lognormal prompt lengths around ``--input-tokens``,
half of them sharing one of 8 prefixes): ``--seconds`` at the fleet's capacity (1x), then
``--seconds`` at ``--factor`` times it. Capacity is ``--rate-1x``, else probed once without
admission (the highest rate of a geometric ladder of ``--probe-s`` rungs at which the engines
served >= 95 % of the requests within the SLOs). Reported per mode and phase: goodput
(requests/s completed within the TTFT and TBT SLOs), SLO attainment, rejections and how fast
the client heard them, the admitted requests that then missed the SLOs (a promise not kept),
TTFT p50 / p99, and the gateway's own TTFT error (``/admin/predictors``, and signed over its
recent decisions). Every process started here is ended by PID.

    python -m bench.real_overload --engine llamacpp --instances 2 --seconds 60 \\
        --json out/real-overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.profile_plan import FIRST_TOKEN_ID  # below it: most vocabularies' special tokens
from bench.emulated_fleet import EmulatedFleet, FleetSpec
from bench.kvgate_serve import KVGATE_MAIN, end_children_on_sigterm, free_port
from bench.overload_report import Phase, phase_summary
from bench.overload_soak import probe_capacity
from bench.phase_load import drive
from bench.policy_rounds import round_orders
from bench.real_prefix_routing import ADMIN_TOKEN, gateway_config, start_engines
from replay.live.loadgen import prompt_ids
from replay.workload.traces import TraceRequest
from tests.real.engines import EngineProcess, stop_engine

LLAMA_ARGS = "-t 1 -tb 1"  # one thread per llama-server: two engines share the 2 cores


class RealEngineFleet(EmulatedFleet):
    """``kvgate serve`` in front of fresh real engines, all in one colocated pool."""

    def __init__(self, spec: FleetSpec, args: argparse.Namespace, profile: Path | None) -> None:
        super().__init__(spec)
        self.token = ADMIN_TOKEN  # gateway_config's
        self.args = args
        self.profile = profile
        self.real: list[EngineProcess] = []

    @property
    def model(self) -> str:
        return self.real[0].model

    def _start_engines(self) -> dict[str, str]:
        a = self.args
        extra = shlex.split(a.engine_args)
        self.real = start_engines(a.engine, a.instances, self.spec.workdir, a.slots, extra)
        return {f"e{i}": e.url for i, e in enumerate(self.real)}

    def _config(self, urls: dict[str, str]) -> str:
        s = self.spec
        lines = ["[slo]", f"ttft_s = {s.ttft_slo_s}", f"tbt_s = {s.tbt_slo_s}"]
        if self.profile is not None:
            lines += ["[predictors]", f'profile_file = "{self.profile}"']
        return gateway_config(
            self.real, s.policy, s.base_port, "\n".join(lines), None, admission=s.admission
        )

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for e in self.real:
                stop_engine(e)
            self.real = []


def token_ids(vocab_size: int) -> Callable[[TraceRequest], list[int]]:
    """Prompt token ids for a request, folded into [FIRST_TOKEN_ID, vocab_size): any model."""
    span = vocab_size - FIRST_TOKEN_ID

    def encode(tr: TraceRequest) -> list[int]:
        return [FIRST_TOKEN_ID + t % span for t in prompt_ids(tr, {})]

    return encode


def measure_profile(args: argparse.Namespace, workdir: Path) -> Path:
    """``kvgate profile`` against one fresh engine of the kind benchmarked."""
    out = workdir / "profile.json"
    engine = start_engines(args.engine, 1, workdir, args.slots, shlex.split(args.engine_args))[0]
    try:
        argv = [sys.executable, "-c", KVGATE_MAIN, "profile", "--target", engine.url]
        argv += ["--model", engine.model, "--out", str(out), "--quiet"]
        # 4x the mean prompt covers the lognormal's tail; 3072 keeps below a llama-server
        # slot's context (-c 8192 over -np 2): the profile's own default
        argv += ["--max-prompt-tokens", str(min(4 * args.input_tokens, 3072))]
        argv += ["--max-seconds", str(args.profile_seconds), "--vocab-size", str(args.vocab_size)]
        subprocess.run(argv, check=True, timeout=args.profile_seconds + 120)
    finally:
        stop_engine(engine)
    return out


def spec_for(args: argparse.Namespace, workdir: Path, admission: str) -> FleetSpec:
    return FleetSpec(
        workdir=workdir,
        base_port=free_port(),
        admission=admission,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        start_timeout_s=60.0,
    )


async def _probe(fleet: RealEngineFleet, args: argparse.Namespace) -> tuple[float, list]:
    return await probe_capacity(fleet, args, encode=token_ids(args.vocab_size), model=fleet.model)


async def _phases(
    fleet: RealEngineFleet, phases: list[Phase], args: argparse.Namespace
) -> list[dict[str, Any]]:
    run = await drive(fleet, phases, args, encode=token_ids(args.vocab_size), model=fleet.model)
    return [phase_summary(run, k, args) for k in range(len(phases))]


def run_mode(
    args: argparse.Namespace, mode: str, rate: float, workdir: Path, profile: Path | None
) -> dict[str, Any]:
    """One admission mode: fresh engines and gateway, 1x then ``--factor`` x."""
    phases = [
        Phase("1x", rate, args.seconds),
        Phase(f"{args.factor:g}x", args.factor * rate, args.seconds),
    ]
    workdir.mkdir(parents=True, exist_ok=True)
    with RealEngineFleet(spec_for(args, workdir, mode), args, profile) as fleet:
        summaries = asyncio.run(_phases(fleet, phases, args))
        predictors = fleet.admin("/admin/predictors")
        decisions = fleet.admin(f"/admin/decisions?limit={fleet.spec.recent_decisions}")
        state = fleet.admin("/admin/state")
        books = fleet.settled_books().as_dict()
        tracebacks = fleet.log_tracebacks()
    one, over = summaries
    g1, g2 = one["goodput_rps"], over["goodput_rps"]
    return {
        "admission": mode,
        "phases": summaries,
        "goodput_ratio_over_1x": round(g2 / g1, 3) if g1 else None,
        "gateway_ttft_mape_pct": predictors.get("ttft_mape_pct"),
        "queue_scales": predictors.get("queue_scales"),
        "wait_margin": state.get("wait_margin"),  # routing/wait_margin.py, per model
        "stall_credit": state.get("stall_credit"),  # routing/stall_credit.py, per model
        "ttft_error_last_decisions": prediction_error(decisions, "ttft"),
        "gateway_tbt_mape_pct": predictors.get("tbt_mape_pct"),
        "tbt_error_last_decisions": prediction_error(decisions, "tbt"),
        "late_last_decisions": late_decisions(decisions, args.ttft_slo),
        "books_end": books,
        "gateway_tracebacks": tracebacks,
    }


def prediction_error(decisions: list[dict[str, Any]], what: str) -> dict[str, Any]:
    """Predicted vs observed TTFT or mean TBT (``what``) of the requests the gateway placed and
    saw answered (its recent decisions: the end of the overload phase): signed (predicted −
    observed) / observed, median and p10 / p90 (negative: the gateway expected it sooner)."""
    pred, seen = f"predicted_{what}_s", f"observed_{what}_s"
    errors = sorted(
        (d[pred] - d[seen]) / d[seen] for d in decisions if d.get(seen) and d.get(pred) is not None
    )
    if not errors:
        return {"n": 0}

    def pick(q: float) -> float:
        return round(errors[min(len(errors) - 1, int(q * len(errors)))], 3)

    return {"n": len(errors), "p10": pick(0.1), "median": pick(0.5), "p90": pick(0.9)}


def late_decisions(decisions: list[dict[str, Any]], ttft_slo_s: float) -> dict[str, Any]:
    """The recent decisions whose first token came after the TTFT SLO: how many, and what
    the gateway had predicted for them (median seconds): whether the wait it saw was short
    (a promise broken by the engine's spread) or long (by admitting up to the edge)."""
    late = [d for d in decisions if (d.get("observed_ttft_s") or 0.0) > ttft_slo_s]
    if not late:
        return {"n": 0}

    def median(key: str) -> float:
        return round(statistics.median(d.get(key) or 0.0 for d in late), 4)

    return {
        "n": len(late),
        "predicted_ttft_s": median("predicted_ttft_s"),
        "predicted_queue_s": median("predicted_queue_s"),
        "predicted_prefill_s": median("predicted_prefill_s"),
        "observed_ttft_s": median("observed_ttft_s"),
    }


def overload_ratios(runs: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    """Each mode's goodput in the overload phase over ``reference``'s, within each round."""
    by_round: dict[int, dict[str, float | None]] = {}
    for run in runs:
        by_round.setdefault(run["round"], {})[run["admission"]] = run["phases"][1]["goodput_rps"]
    out: dict[str, Any] = {}
    for rnd in sorted(by_round):
        ref = by_round[rnd].get(reference)
        for mode, goodput in by_round[rnd].items():
            if mode != reference and ref and goodput is not None:
                out.setdefault(mode, []).append(round(goodput / ref, 3))
    return {mode: {"per_round": r, "median": statistics.median(r)} for mode, r in out.items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.real_overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=["llamacpp", "vllm"], default="llamacpp")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--slots", type=int, default=2, help="llama.cpp -np")
    p.add_argument(
        "--engine-args",
        default=None,
        help=f"extra engine arguments, shell-quoted (llama.cpp default: {LLAMA_ARGS!r})",
    )
    p.add_argument("--modes", default="none,early", help="admission modes to compare")
    p.add_argument("--reference", default="none", help="the mode the ratios are taken against")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seconds", type=float, default=60.0, help="per phase")
    p.add_argument("--factor", type=float, default=3.0, help="overload phase: this x capacity")
    p.add_argument("--rate-1x", type=float, default=None, help="capacity (req/s); default probed")
    p.add_argument("--probe-start", type=float, default=1.0)
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--probe-s", type=float, default=30.0)
    p.add_argument("--profile", default=None, help="a kvgate profile file; default: measured")
    p.add_argument("--profile-seconds", type=float, default=120.0, help="kvgate profile's cap")
    p.add_argument("--input-tokens", type=int, default=1024, help="mean prompt length")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--ttft-slo", type=float, default=1.0)
    p.add_argument("--tbt-slo", type=float, default=0.2)
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="configs, profile and logs (default: temp)")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed and checked arguments (argparse exits 2 with a message on bad ones)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.engine_args is None:
        args.engine_args = LLAMA_ARGS if args.engine == "llamacpp" else ""
    args.mode_list = [m for m in args.modes.split(",") if m]
    if not args.mode_list or not set(args.mode_list) <= {"none", "early", "predictive"}:
        parser.error("--modes: a comma-separated list of none, early, predictive")
    if len(args.mode_list) > 1 and args.reference not in args.mode_list:
        parser.error("--reference must be one of --modes")
    positive = (args.seconds, args.factor, args.probe_s, args.probe_start, args.ttft_slo)
    if min(*positive, args.tbt_slo, args.profile_seconds) <= 0 or args.rounds < 1:
        parser.error("durations, --factor and the SLOs must be > 0, --rounds >= 1")
    if args.rate_1x is not None and args.rate_1x <= 0:
        parser.error("--rate-1x must be > 0")
    if args.vocab_size <= FIRST_TOKEN_ID + 1:
        parser.error(f"--vocab-size must be > {FIRST_TOKEN_ID + 1}")
    if args.profile is not None and not Path(args.profile).is_file():
        parser.error(f"--profile: no such file: {args.profile}")
    return args


def _say(msg: str) -> None:
    print(f"[real_overload] {msg}", file=sys.stderr, flush=True)


def progress_line(run: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f} %"

    cells = []
    for s in run["phases"]:
        good = s["goodput_rps"]
        cells.append(
            f"{s['phase']}: goodput {'-' if good is None else f'{good:.2f}'} r/s"
            f" (attainment {pct(s['slo_attainment'])}), rejected {s['rejected']},"
            f" admitted {s['admitted']} of which late {pct(s['admitted_slo_miss_ratio'])}"
        )
    return f"{run['admission']}: " + "; ".join(cells)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    end_children_on_sigterm()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvgate-real-overload-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile = Path(args.profile).resolve()
    else:
        _say(f"profiling {args.engine} (kvgate profile, <= {args.profile_seconds:g} s)")
        profile = measure_profile(args, workdir)
    rate, ladder = args.rate_1x, None
    if rate is None:
        _say("probing capacity (admission none: what the engines serve within the SLOs)")
        probe_dir = workdir / "probe"
        probe_dir.mkdir(exist_ok=True)
        with RealEngineFleet(spec_for(args, probe_dir, "none"), args, profile) as fleet:
            rate, ladder = asyncio.run(_probe(fleet, args))
        _say(f"capacity 1x = {rate:g} req/s")
    runs = []
    for rnd, order in enumerate(round_orders(args.mode_list, args.rounds)):
        for mode in order:
            _say(
                f"round {rnd + 1}: admission {mode} ({args.factor:g}x = {args.factor * rate:g} r/s)"
            )
            res = {"round": rnd, **run_mode(args, mode, rate, workdir / f"r{rnd}-{mode}", profile)}
            _say(progress_line(res))
            runs.append(res)
    report: dict[str, Any] = {
        "engine": args.engine,
        "instances": args.instances,
        "rate_1x_rps": rate,
        "rate_source": "probe" if ladder else "configured",
        "probe": ladder,
        "profile": str(profile),
        "workdir": str(workdir),  # each run's configs and engine / gateway logs
        "runs": runs,
        "args": {k: v for k, v in vars(args).items() if k != "mode_list"},
    }
    if len(args.mode_list) > 1:
        report["overload_goodput_ratios_to"] = args.reference
        report["overload_goodput_ratios"] = overload_ratios(runs, args.reference)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
