"""PNG plots of replay runs: TTFT CDFs and Mooncake-style load timelines (Figures 9-10).

matplotlib is optional (the ``plots`` extra) and imported lazily. Figures are drawn on the
Agg canvas directly (no pyplot), so plotting never touches global GUI/backend state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replay.report.report import load_timeline, oscillation
from replay.report.results import Outcome, RunResult

FIGSIZE = (8.0, 6.0)
DPI = 100


def _figure(nrows: int = 1, *, sharex: bool = True) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("plots need matplotlib: pip install 'kvgate[plots]'") from e
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0]
    return fig, axes


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, format="png")
    return path


def _nan(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def _centers(tl: dict[str, Any]) -> list[float]:
    return [t + tl["bucket_s"] / 2 for t in tl["t_s"]]


def plot_ttft_cdf(runs: Sequence[RunResult], path: str | Path) -> Path:
    """Empirical TTFT CDF of completed requests, one line per run; dashed TTFT SLO line(s)."""
    fig, (ax,) = _figure()
    lo, hi = float("inf"), 0.0
    for run in runs:
        ttfts = sorted(
            r.ttft_s
            for r in run.requests
            if r.outcome is Outcome.COMPLETED and r.ttft_s is not None
        )
        if not ttfts:
            continue
        n = len(ttfts)
        ys = [(i + 1) / n for i in range(n)]
        ax.step(ttfts, ys, where="post", label=f"{run.label} (n={n})")
        lo, hi = min(lo, ttfts[0]), max(hi, ttfts[-1])
    for slo in sorted({run.ttft_slo_s for run in runs if run.ttft_slo_s > 0}):
        ax.axvline(slo, color="black", linestyle="--", linewidth=1, label=f"TTFT SLO ({slo:g} s)")
        lo, hi = min(lo, slo), max(hi, slo)
    if hi == 0.0:
        ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
    elif lo > 0 and hi / lo > 100:
        ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    return _save(fig, path)


def plot_load(run: RunResult, path: str | Path, *, bucket_s: float = 10.0) -> Path:
    """Prefill load, decode load and admitted/rejected arrivals over time for one run."""
    tl = load_timeline(run, bucket_s)
    x = _centers(tl)
    fig, (ax_p, ax_d, ax_a) = _figure(3)
    prefill = tl["prefill_queue_s"]
    ax_p.plot(x, _nan(prefill), marker=".", color="tab:blue")
    ax_p.set_ylabel("prefill load\n(mean queue, s)")
    ax_p.set_title(
        f"{run.label}: load over time ({bucket_s:g} s buckets)\n"
        f"oscillation: prefill {oscillation(prefill):.2f}, "
        f"decode {oscillation(tl['decode_load']):.2f}"
    )
    ax_d.plot(x, _nan(tl["decode_load"]), marker=".", color="tab:orange")
    ax_d.axhline(1.0, color="black", linestyle="--", linewidth=1, label="TBT SLO")
    ax_d.set_ylabel("decode load\n(TBT / SLO)")
    ax_d.legend(loc="best")
    width = bucket_s * 0.9
    ax_a.bar(x, tl["admitted"], width=width, color="tab:green", label="admitted")
    ax_a.bar(
        x, tl["rejected"], width=width, bottom=tl["admitted"], color="tab:red", label="rejected"
    )
    ax_a.set_ylabel(f"requests per\n{bucket_s:g} s")
    ax_a.set_xlabel("time (s)")
    ax_a.legend(loc="best")
    for ax in (ax_p, ax_d, ax_a):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    return _save(fig, path)


def plot_load_comparison(
    runs: Sequence[RunResult], path: str | Path, *, bucket_s: float = 10.0
) -> Path:
    """Decode (top) and prefill (bottom) load of several runs overlaid, oscillation in legend."""
    fig, (ax_d, ax_p) = _figure(2)
    for run in runs:
        tl = load_timeline(run, bucket_s)
        x = _centers(tl)
        dec, pre = tl["decode_load"], tl["prefill_queue_s"]
        ax_d.plot(x, _nan(dec), marker=".", label=f"{run.label} (osc {oscillation(dec):.2f})")
        ax_p.plot(x, _nan(pre), marker=".", label=f"{run.label} (osc {oscillation(pre):.2f})")
    ax_d.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax_d.set_title(f"load over time ({bucket_s:g} s buckets)")
    ax_d.set_ylabel("decode load (TBT / SLO)")
    ax_p.set_ylabel("prefill load (mean queue, s)")
    ax_p.set_xlabel("time (s)")
    for ax in (ax_d, ax_p):
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    return _save(fig, path)


def safe_name(label: str) -> str:
    """A label as a file-name fragment: runs of other than ``[A-Za-z0-9._-]`` become ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "run"


def write_plots(
    runs: Sequence[RunResult], directory: str | Path, *, bucket_s: float = 10.0
) -> list[Path]:
    """``ttft_cdf.png``, ``load_<label>.png`` per run, ``load_comparison.png`` if > 1 run."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = [plot_ttft_cdf(runs, directory / "ttft_cdf.png")]
    used: set[str] = set()
    for run in runs:
        name, k = safe_name(run.label), 2
        base = name
        while name in used:
            name, k = f"{base}_{k}", k + 1
        used.add(name)
        paths.append(plot_load(run, directory / f"load_{name}.png", bucket_s=bucket_s))
    if len(runs) > 1:
        paths.append(
            plot_load_comparison(runs, directory / "load_comparison.png", bucket_s=bucket_s)
        )
    return paths
