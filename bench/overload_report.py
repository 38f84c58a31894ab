"""What an overload or soak run produced (``bench.overload_soak``) and how it is summarised:
per-phase goodput and rejection latency, gateway RSS and CPU over time, RSS growth after the
warm-up, the books' bounds."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.rejection_path import probe_summary
from replay.report.report import summarize
from replay.report.results import Outcome, RequestOutcome, RunResult

WARMUP_FRACTION = 0.2  # soak: RSS growth is measured after this share of the run


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    rate_rps: float
    duration_s: float


@dataclass(slots=True)
class Sample:
    t_s: float
    rss_kb: int | None
    cpu_s: float | None  # the gateway's CPU seconds so far
    load_1m: float  # the machine's 1-minute load average (a shared machine skews latency)
    books: dict[str, int] | None
    client_pending: int


@dataclass(slots=True)
class PhaseRun:
    """What one run of consecutive phases produced."""

    phases: list[Phase]
    outcomes: list[list[RequestOutcome]]  # per phase, by arrival
    reject_ms: list[list[float]]  # per phase: send -> 429/503 answer, admission rejections
    samples: list[Sample] = field(default_factory=list)
    # (seconds, target, ms): GET /health of the gateway and of one engine, a control for how
    # late the machine (shared, 2 cores) schedules the client and the servers at all.
    pings: list[tuple[float, str, float]] = field(default_factory=list)
    cut_short: bool = False
    # Per phase: the rejection probe's rows [epoch_s, ms, status, reason, hopeless]
    # (``bench.rejection_path --live``), when it ran.
    probe: list[list[list[Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.probe:
            self.probe = [[] for _ in self.phases]


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def phase_summary(run: PhaseRun, k: int, args: argparse.Namespace) -> dict[str, Any]:
    ph = run.phases[k]
    rr = RunResult(
        label=ph.name,
        policy="live",
        admission="early",
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        duration_s=ph.duration_s,
    )
    rr.requests = run.outcomes[k]
    s = summarize(rr)
    keep = (
        "requests",
        "admitted",
        "completed",
        "rejected",
        "rejected_after_prefill",
        "failed",
        "slo_met",
        "admitted_slo_miss_ratio",  # admitted, then missed the SLOs: a promise not kept
        "promised_slo_miss_ratio",  # the same, best-effort admissions (no promise) left out
        "slo_attainment",
        "goodput_rps",
        "throughput_rps",
        "ttft_p50_s",
        "ttft_p99_s",
        "tbt_p99_s",
        "rejections_by_reason",
    )
    out = {"phase": ph.name, "rate_rps": ph.rate_rps, "duration_s": ph.duration_s}
    out.update({key: s.get(key) for key in keep})
    failures: dict[str, int] = {}
    for r in run.outcomes[k]:
        if r.outcome is Outcome.FAILED:
            failures[r.reason[:80]] = failures.get(r.reason[:80], 0) + 1
    out["failures_by_reason"] = failures
    # Which promise broke: completed requests over each SLO (one may break both).
    done = [r for r in run.outcomes[k] if r.outcome is Outcome.COMPLETED]
    out["completed_over_ttft_slo"] = sum(r.ttft_s is None or r.ttft_s > args.ttft_slo for r in done)
    out["completed_over_tbt_slo"] = sum((r.tbt_mean_s or 0.0) > args.tbt_slo for r in done)
    rej = run.reject_ms[k]
    out["reject_ms"] = {
        "n": len(rej),
        "p50": _pct(rej, 50),
        "p99": _pct(rej, 99),
        "max": _pct(rej, 100),
    }
    if run.probe[k]:
        out["reject_probe_ms"] = probe_summary(run.probe[k])
    start = sum(p.duration_s for p in run.phases[:k])
    for target in sorted({name for _, name, _ in run.pings}):
        ms = [
            v for t, name, v in run.pings if name == target and start <= t < start + ph.duration_s
        ]
        out[f"health_ms_{target}"] = {"n": len(ms), "p50": _pct(ms, 50), "p99": _pct(ms, 99)}
    return out


def series(run: PhaseRun) -> dict[str, list[Any]]:
    """Per sample: seconds, gateway RSS (KiB), gateway CPU share since the previous sample,
    machine load average, requests in flight at the gateway, open client requests."""
    out: dict[str, list[Any]] = {
        k: [] for k in ("t_s", "rss_kb", "cpu", "load_1m", "in_flight", "client_open")
    }
    prev: Sample | None = None
    for s in run.samples:
        out["t_s"].append(round(s.t_s, 1))
        out["rss_kb"].append(s.rss_kb)
        share = None
        if prev and s.cpu_s is not None and prev.cpu_s is not None and s.t_s > prev.t_s:
            share = round((s.cpu_s - prev.cpu_s) / (s.t_s - prev.t_s), 3)
        out["cpu"].append(share)
        out["load_1m"].append(round(s.load_1m, 2))
        out["in_flight"].append(s.books["requests_in_flight"] if s.books else None)
        out["client_open"].append(s.client_pending)
        prev = s
    return out


def filled_at(run: PhaseRun, decision_bound: int) -> float | None:
    """When the gateway's slowest bounded structures were first full: the decision history
    (``recent_decisions``) and the learner's window (``refit_window``); None if never. RSS
    that grows before then is those structures (and the refits that train on the growing
    window) filling, not a leak."""
    for s in run.samples:
        b = s.books
        if (
            b
            and b["decision_history"] >= decision_bound
            and b["learner_samples"] >= b["learner_window"]
        ):
            return s.t_s
    return None


def _growth(run: PhaseRun, from_s: float) -> dict[str, Any]:
    after = [s for s in run.samples if s.rss_kb is not None and s.t_s >= from_s]
    if len(after) < 2:
        return {"baseline_kb": None, "end_kb": None, "growth_pct": None, "max_growth_pct": None}
    base, end = after[0].rss_kb or 0, after[-1].rss_kb or 0
    peak = max(s.rss_kb or 0 for s in after)
    return {
        "warmup_s": round(from_s, 1),
        "baseline_kb": base,
        "end_kb": end,
        "max_kb": peak,
        "growth_pct": round(100 * (end - base) / base, 2),
        "max_growth_pct": round(100 * (peak - base) / base, 2),
    }


def rss_growth(run: PhaseRun, total_s: float, decision_bound: int) -> dict[str, Any]:
    """RSS growth after the warm-up (the last sample against the first one after it). The
    warm-up lasts the first 20 % of the run and until the bounded structures are full
    (``filled_at``); ``warmup_over`` False: they never filled, and the growth shown (after
    the 20 %) still includes their filling (an upper bound on a leak's share).
    ``fixed_20pct``: the growth after the 20 % alone."""
    fixed = WARMUP_FRACTION * total_s
    full = filled_at(run, decision_bound)
    out = _growth(run, max(fixed, full) if full is not None else fixed)
    out["filled_at_s"] = None if full is None else round(full, 1)
    out["warmup_over"] = full is not None
    out["fixed_20pct"] = _growth(run, fixed)
    return out


def kv_index_flat(run: PhaseRun, total_s: float, slack: float = 1.05) -> bool:
    """Whether the KV index stopped growing: its largest size after the warm-up is at most
    ``slack`` times its largest size during it (it fills to the engines' capacity, then evicts)."""
    cut = WARMUP_FRACTION * total_s
    sizes = [(s.t_s, s.books["kv_index_blocks"]) for s in run.samples if s.books]
    early = [n for t, n in sizes if t < cut]
    late = [n for t, n in sizes if t >= cut]
    return bool(early and late) and max(late) <= slack * max(early)


def books_bounds(run: PhaseRun) -> dict[str, Any]:
    books = [s.books for s in run.samples if s.books]
    if not books:
        return {}
    return {
        "kv_index_blocks_max": max(b["kv_index_blocks"] for b in books),
        "kv_index_blocks_series": [b["kv_index_blocks"] for b in books],
        "decision_history_max": max(b["decision_history"] for b in books),
        "requests_in_flight_max": max(b["requests_in_flight"] for b in books),
    }


def format_report(rep: dict[str, Any]) -> str:
    lines = [f"{rep['mode']}: 1x = {rep['rate_1x_rps']} req/s ({rep['rate_source']})"]
    head = f"{'phase':6} {'rate':>6} {'reqs':>6} {'good/s':>7} {'attain':>7} {'rej':>6} "
    lines.append(
        head
        + f"{'fail':>5} {'rej p50':>8} {'rej p99':>8} {'ttft p99':>9} {'/health p99 gw, eng':>20}"
    )
    for s in rep["phases"]:
        r = s["reject_ms"]
        gw = (s.get("health_ms_gateway") or {}).get("p99")
        eng = (s.get("health_ms_engine") or {}).get("p99")
        lines.append(
            f"{s['phase']:6} {s['rate_rps']:6.2f} {s['requests']:6d} {s['goodput_rps'] or 0:7.2f} "
            f"{s['slo_attainment'] or 0:7.3f} {s['rejected']:6d} {s['failed']:5d} "
            f"{r['p50'] if r['p50'] is not None else '-':>8} "
            f"{r['p99'] if r['p99'] is not None else '-':>8} {s['ttft_p99_s'] or 0:9.3f} "
            f"{f'{gw}, {eng}':>20}"
        )
    for s in rep["phases"]:
        pr = s.get("reject_probe_ms")
        if pr:
            a, h, f = pr["all"], pr["hopeless"], pr["full"]
            lines.append(
                f"reject probe {s['phase']}: {pr['rejected']}/{pr['sent']} rejected, p50/p90/p99 "
                f"{a['p50']}/{a['p90']}/{a['p99']} ms; hopeless n={h['n']} p50/p99 "
                f"{h['p50']}/{h['p99']}; full n={f['n']} p50/p99 {f['p50']}/{f['p99']}"
            )
    g = rep["rss_growth"]
    f20 = g.get("fixed_20pct") or {}
    lines.append(
        f"gateway RSS: {len(rep['samples']['t_s'])} samples, "
        f"after warm-up ({g.get('warmup_s')} s; structures full at {g.get('filled_at_s')} s) "
        f"{g.get('baseline_kb')} -> {g.get('end_kb')} KiB ({g.get('growth_pct')} %, "
        f"max {g.get('max_growth_pct')} %); after the first 20 % alone: "
        f"{f20.get('growth_pct')} %, max {f20.get('max_growth_pct')} %"
    )
    lines.append(f"books at end: {rep['books_end']}")
    if "goodput_ratio_3x_1x" in rep:
        lines.append(f"goodput 3x / 1x: {rep['goodput_ratio_3x_1x']}")
    lines.append(f"targets met: {rep['targets_met']}")
    return "\n".join(lines)
