"""Summary metrics of replay runs: JSON-ready dicts, a terminal table, load timelines.

Definitions used by :func:`summarize` (``n`` = number of requests in the run):

* ``rejected``: outcome ``REJECTED`` (refused by admission before any GPU work).
* ``admitted``: every other request (``outcome != REJECTED``), so it includes requests that
  were later ``REJECTED_AFTER_PREFILL`` or ``FAILED``.
* ``rejected_after_prefill``: outcome ``REJECTED_AFTER_PREFILL`` (prefill work wasted);
  ``wasted_prefill_ratio`` = rejected_after_prefill / admitted.
* ``best_effort_admitted``: admitted without the TTFT promise (``RequestOutcome.best_effort``,
  routing/best_effort.py), ``best_effort_slo_met`` of them met both SLOs anyway;
  ``admitted_slo_miss_ratio`` = (admitted - slo_met) / admitted counts them, and
  ``promised_slo_miss_ratio`` is the same share over the other admitted requests only.
* ``rejections_by_reason``: counts keyed ``"before_prefill:<reason>"`` (``REJECTED``) and
  ``"after_prefill:<reason>"`` (``REJECTED_AFTER_PREFILL``); an empty reason is ``"unknown"``.
* ``goodput_rps``: requests meeting both SLOs (:meth:`RequestOutcome.meets_slo`) / duration_s;
  ``throughput_rps``: completed requests / duration_s. Both ``None`` if duration_s <= 0.
* ``slo_attainment``: requests meeting both SLOs / n (rejected requests count as misses).
* TTFT statistics are over ``COMPLETED`` requests that have a ``ttft_s``.
* TBT percentiles are token-weighted over ``run.tbt_steps`` ((step seconds, tokens) pairs).
  Without steps they fall back to the completed requests' ``tbt_mean_s``, each weighted by its
  number of inter-token gaps, ``max(generated - 1, 1)``; ``tbt_source`` says which was used.
* Percentiles (TTFT and TBT) are nearest-rank: the first value, in sorted order, whose
  cumulative weight reaches ``q * total weight`` (for TTFT every weight is 1).
* ``cache_hit_ratio``: sum(cached_tokens) / sum(prompt_tokens) over prefilled requests
  (``prefill_instance`` set and outcome ``COMPLETED`` or ``REJECTED_AFTER_PREFILL``).
* ``sim_speedup`` = duration_s / wall_s and ``requests_per_wall_s`` = n / wall_s (if wall_s > 0).
* Load ("Mooncake load"): prefill load is the mean predicted queue in seconds over prefill
  instances; decode load is the mean decode step time divided by the TBT SLO over decode
  instances (instances with role ``both`` count for both). See :func:`load_timeline`.
* ``prefill_load_oscillation`` / ``decode_load_oscillation``: :func:`oscillation` of the load
  timeline with ``bucket_s`` buckets (default 10 s).
* Everything in ``run.extra`` is copied in; computed keys win on a name clash.

Undefined statistics (empty run, no completed request, ...) are ``None`` (JSON ``null``);
no value is ever NaN or infinite.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from replay.report.prediction_errors import prediction_errors
from replay.report.results import Outcome, RunResult

PREFILL_ROLES = frozenset({"prefill", "both"})
DECODE_ROLES = frozenset({"decode", "both"})


def weighted_percentile(
    values: Sequence[float], weights: Sequence[float], q: float
) -> float | None:
    """Nearest-rank weighted percentile, ``q`` in [0, 1]; ``None`` if the total weight is 0."""
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    if v.size == 0 or w.sum() <= 0:
        return None
    order = np.argsort(v, kind="stable")
    v, cum = v[order], np.cumsum(w[order])
    total = cum[-1]
    # A relative tolerance keeps e.g. q=0.9 of 10 equal weights exactly on the 9th value.
    idx = int(np.searchsorted(cum, q * total - 1e-9 * total, side="left"))
    return float(v[min(idx, v.size - 1)])


def _clean(x: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, NaN/inf to None, recursively."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


# The keys every run summary has (the contract `kvgate sim --json` and `kvgate replay` keep).
REQUIRED_KEYS = (
    "policy",
    "admission",
    "requests",
    "admitted",
    "rejected",
    "rejected_after_prefill",
    "goodput_rps",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "tbt_p50_s",
    "tbt_p99_s",
    "slo_attainment",
    "cache_hit_ratio",
    "wall_s",
)


def summarize(run: RunResult, *, bucket_s: float = 10.0) -> dict[str, Any]:
    """Summary metrics of one run as a JSON-ready dict (see the module docstring)."""
    reqs = run.requests
    n = len(reqs)
    counts = Counter(r.outcome for r in reqs)
    rejected = counts[Outcome.REJECTED]
    after = counts[Outcome.REJECTED_AFTER_PREFILL]
    admitted = n - rejected
    good = sum(r.meets_slo(run.ttft_slo_s, run.tbt_slo_s) for r in reqs)

    completed = [r for r in reqs if r.outcome is Outcome.COMPLETED]
    ttfts = [r.ttft_s for r in completed if r.ttft_s is not None]
    ones = [1.0] * len(ttfts)

    if run.tbt_steps:
        tbt_vals = [s for s, _ in run.tbt_steps]
        tbt_w = [float(t) for _, t in run.tbt_steps]
        tbt_source = "steps"
    else:
        with_tbt = [r for r in completed if r.tbt_mean_s is not None]
        tbt_vals = [r.tbt_mean_s for r in with_tbt]
        tbt_w = [float(max(r.generated - 1, 1)) for r in with_tbt]
        tbt_source = "requests" if with_tbt else None
    tbt_total = sum(tbt_w)

    late = [r for r in reqs if r.best_effort]
    late_good = sum(r.meets_slo(run.ttft_slo_s, run.tbt_slo_s) for r in late)

    reasons: Counter[str] = Counter()
    for r in reqs:
        if r.outcome is Outcome.REJECTED:
            reasons[f"before_prefill:{r.reason or 'unknown'}"] += 1
        elif r.outcome is Outcome.REJECTED_AFTER_PREFILL:
            reasons[f"after_prefill:{r.reason or 'unknown'}"] += 1

    prefilled = [
        r
        for r in reqs
        if r.prefill_instance is not None
        and r.outcome in (Outcome.COMPLETED, Outcome.REJECTED_AFTER_PREFILL)
    ]
    prompt_sum = sum(r.prompt_tokens for r in prefilled)
    timeline = load_timeline(run, bucket_s)
    has_prefill = any(s.role in PREFILL_ROLES for s in run.load)
    has_decode = any(s.role in DECODE_ROLES for s in run.load)

    out: dict[str, Any] = {
        "label": run.label,
        "policy": run.policy,
        "admission": run.admission,
        "requests": n,
        "admitted": admitted,
        "rejected": rejected,
        "rejected_after_prefill": after,
        "completed": len(completed),
        "failed": counts[Outcome.FAILED],
        "slo_met": good,
        "wasted_prefill_ratio": _ratio(after, admitted),
        # admitted, then missed an SLO anyway (incl. refused after prefill, failed)
        "admitted_slo_miss_ratio": _ratio(admitted - good, admitted),
        # served without the TTFT promise (routing/best_effort.py), and how many met it anyway
        "best_effort_admitted": len(late),
        "best_effort_slo_met": late_good,
        # the admitted-then-missed share among requests admitted with the full promise
        "promised_slo_miss_ratio": _ratio(
            admitted - len(late) - (good - late_good), admitted - len(late)
        ),
        "rejections_by_reason": dict(sorted(reasons.items())),
        "ttft_slo_s": run.ttft_slo_s,
        "tbt_slo_s": run.tbt_slo_s,
        "duration_s": run.duration_s,
        "goodput_rps": _ratio(good, run.duration_s),
        "throughput_rps": _ratio(len(completed), run.duration_s),
        "slo_attainment": _ratio(good, n),
        "ttft_mean_s": float(np.mean(ttfts)) if ttfts else None,
        "ttft_p50_s": weighted_percentile(ttfts, ones, 0.50),
        "ttft_p90_s": weighted_percentile(ttfts, ones, 0.90),
        "ttft_p99_s": weighted_percentile(ttfts, ones, 0.99),
        "tbt_mean_s": _ratio(float(np.dot(tbt_vals, tbt_w)), tbt_total) if tbt_vals else None,
        "tbt_p50_s": weighted_percentile(tbt_vals, tbt_w, 0.50),
        "tbt_p99_s": weighted_percentile(tbt_vals, tbt_w, 0.99),
        "tbt_source": tbt_source,
        "cache_hit_ratio": _ratio(sum(r.cached_tokens for r in prefilled), prompt_sum),
        "transferred_bytes": run.transferred_bytes,
        "kv_transfer_bytes": run.kv_transfer_bytes,
        "replication_commands": run.replication_commands,
        "replicated_bytes": run.replicated_bytes,
        "prefill_load_oscillation": (
            oscillation(timeline["prefill_queue_s"]) if has_prefill else None
        ),
        "decode_load_oscillation": oscillation(timeline["decode_load"]) if has_decode else None,
        "prefill_hotspot_ratio": hotspot_ratio(run),
        "wall_s": run.wall_s,
        "sim_speedup": _ratio(run.duration_s, run.wall_s),
        "requests_per_wall_s": _ratio(n, run.wall_s),
    }
    out["prediction_errors"] = prediction_errors(run)
    for k, v in run.extra.items():
        out.setdefault(k, v)
    return _clean(out)


def hotspot_ratio(run: RunResult) -> float | None:
    """How much one prefill instance is the bottleneck: over the load samples taken while any
    prefill queue was non-empty, the mean of (busiest instance's queue / mean queue). 1.0 =
    perfectly even; N = all the backlog on one of N instances."""
    by_time: dict[float, list[float]] = {}
    for s in run.load:
        if s.role != "decode":
            by_time.setdefault(s.time_s, []).append(s.queue_s)
    ratios = [max(q) / (sum(q) / len(q)) for q in by_time.values() if q and sum(q) > 0]
    return sum(ratios) / len(ratios) if ratios else None


def _bucket_mean(sums: list[float], counts: list[int]) -> list[float | None]:
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def load_timeline(run: RunResult, bucket_s: float) -> dict[str, Any]:
    """Per-bucket load and arrivals; bucket ``i`` covers ``[i*bucket_s, (i+1)*bucket_s)``.

    Keys (lists have one entry per bucket; a mean over no samples is ``None``):
    ``bucket_s``, ``t_s`` (bucket start), ``prefill_queue_s`` and ``prefill_queued`` (mean
    ``queue_s`` / ``queued_prefills`` over prefill samples), ``decode_batch`` and
    ``decode_load`` (mean ``decode_batch`` / ``tbt_s / tbt_slo_s`` over decode samples),
    ``arrivals``, ``admitted`` (outcome != REJECTED), ``rejected`` and
    ``rejected_after_prefill`` counts by ``arrival_s``. Times past the end clip to the last
    bucket, negative ones to the first.
    """
    if bucket_s <= 0:
        raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
    times = [s.time_s for s in run.load] + [r.arrival_s for r in run.requests]
    end = max([run.duration_s, *times]) if times else 0.0
    has_data = bool(times) or end > 0
    nb = max(math.ceil(end / bucket_s), 1) if has_data else 0

    def idx(t: float) -> int:
        return min(max(int(t // bucket_s), 0), nb - 1)

    def zeros() -> list[Any]:
        return [0] * nb

    pq, pn, pc = zeros(), zeros(), zeros()
    db, dl, dc = zeros(), zeros(), zeros()
    slo = run.tbt_slo_s
    for s in run.load:
        i = idx(s.time_s)
        if s.role in PREFILL_ROLES:
            pq[i] += s.queue_s
            pn[i] += s.queued_prefills
            pc[i] += 1
        if s.role in DECODE_ROLES:
            db[i] += s.decode_batch
            dl[i] += s.tbt_s / slo if slo > 0 else 0.0
            dc[i] += 1
    arrivals, admitted, rejected, after = zeros(), zeros(), zeros(), zeros()
    for r in run.requests:
        i = idx(r.arrival_s)
        arrivals[i] += 1
        if r.outcome is Outcome.REJECTED:
            rejected[i] += 1
        else:
            admitted[i] += 1
            if r.outcome is Outcome.REJECTED_AFTER_PREFILL:
                after[i] += 1
    return _clean(
        {
            "bucket_s": bucket_s,
            "t_s": [i * bucket_s for i in range(nb)],
            "prefill_queue_s": _bucket_mean(pq, pc),
            "prefill_queued": _bucket_mean(pn, pc),
            "decode_batch": _bucket_mean(db, dc),
            "decode_load": _bucket_mean(dl, dc),
            "arrivals": arrivals,
            "admitted": admitted,
            "rejected": rejected,
            "rejected_after_prefill": after,
        }
    )


def oscillation(values: Iterable[float | None]) -> float:
    """Mean absolute first difference divided by the mean absolute value.

    ``None``/NaN entries are dropped. A constant series gives 0; a series alternating between
    0 and ``x`` gives 2; a slow ramp gives a small value (unlike the coefficient of variation,
    a trend is not mistaken for oscillation). Fewer than 2 values, or all zero, give 0.
    """
    v = np.array([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size < 2:
        return 0.0
    scale = float(np.mean(np.abs(v)))
    if scale == 0:
        return 0.0
    return float(np.mean(np.abs(np.diff(v))) / scale)


_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, summary key, format); "%" multiplies by 100, "ms" by 1000.
    ("requests", "requests", "d"),
    ("admitted", "admitted", "d"),
    ("rejected", "rejected", "d"),
    ("rej-after-pf", "rejected_after_prefill", "d"),
    ("goodput r/s", "goodput_rps", ".2f"),
    ("SLO %", "slo_attainment", "%"),
    ("TTFT mean s", "ttft_mean_s", ".3f"),
    ("p50 s", "ttft_p50_s", ".3f"),
    ("p90 s", "ttft_p90_s", ".3f"),
    ("p99 s", "ttft_p99_s", ".3f"),
    ("TBT p50 ms", "tbt_p50_s", "ms"),
    ("p99 ms", "tbt_p99_s", "ms"),
    ("cache %", "cache_hit_ratio", "%"),
    ("wall s", "wall_s", ".1f"),
)


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "%":
        return f"{100 * value:.1f}"
    if fmt == "ms":
        return f"{1000 * value:.1f}"
    if fmt == "d":
        return str(int(value))
    return format(value, fmt)


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """An aligned text table, one row per summary (from :func:`summarize`); None shows "-"."""
    header = ["label", *(h for h, _, _ in _COLUMNS)]
    rows = [
        [str(s.get("label", "")), *(_cell(s.get(k), f) for _, k, f in _COLUMNS)] for s in summaries
    ]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def write_json(
    path: str | Path, summaries: Sequence[dict[str, Any]], *, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``{"runs": [...summaries], **extra}`` as indented JSON; creates parent dirs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = _clean({"runs": list(summaries), **(extra or {})})
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    return path
