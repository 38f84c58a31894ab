"""Compare measured GPU step times with kvgate's step-time profile.

Reads the JSON of ``bench/gpu_step_times.py`` (run on a GPU machine; the H100 run is committed as
``docs/data/gpu-step-times.json``), evaluates kvgate's own predictors for the profile at the same
points (``build_instance_predictors``: the analytic P5 prefill and D2 decode models, with and
without the per-step overhead), prints a table and refits the profile's forms to the measurements
with the same relative least squares the calibration used (``predictors.fitting``).

Three measured times per point (see docs/gpu-step-times.md):
- ``eager``: CUDA-event time of one HF-transformers forward, Python launch gaps included;
- ``kernels``: the sum of its GPU kernel durations (GPU-only, what the profile models);
- decode ``kernels-cat``: minus the ``torch.cat`` re-copy of the KV cache that HF's DynamicCache
  does every step and a paged engine does not (timed apart at the same shape).
``bench/gpu_engine_steps.py`` output (the engine-like forward) reads the same way, except that
its end-to-end time is a CUDA-graph replay (``meta.e2e_label`` "graph") and it has no
``kernels-cat``: it writes the KV cache in place.

    .venv/bin/python -m bench.compare_gpu_profile                       # table
    .venv/bin/python -m bench.compare_gpu_profile --markdown --json /tmp/cmp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from config.settings import PredictorSettings
from predictors.bundle import build_instance_predictors
from predictors.decode import DecodeSamples, DecodeStepModel
from predictors.fitting import fit_p5, relative_nnls
from predictors.profiles import get_profile

DEFAULT_STEPS = Path(__file__).resolve().parent.parent / "docs" / "data" / "gpu-step-times.json"
DEFAULT_PROFILE = "llama3-8b-h100-tp1"


@dataclass(frozen=True, slots=True)
class Row:
    kind: str  # "prefill" | "decode"
    batch: int
    new_tokens: int
    cached_tokens: int  # per sequence
    eager_ms: float
    kernels_ms: float
    kernels_minus_cat_ms: float | None  # decode only
    predicted_ms: float  # kvgate as configured by default (GPU model + overhead)
    predicted_gpu_ms: float  # the profile's GPU-only time

    @property
    def gpu_ratio(self) -> float:
        """Measured kernel time / predicted GPU time (> 1: the profile is optimistic)."""
        return self.kernels_ms / self.predicted_gpu_ms

    @property
    def adjusted_ratio(self) -> float:
        """Like ``gpu_ratio``, decode without HF's cache re-copy (prefill: the same)."""
        adjusted = self.kernels_minus_cat_ms
        return (adjusted if adjusted is not None else self.kernels_ms) / self.predicted_gpu_ms

    @property
    def eager_ratio(self) -> float:
        return self.eager_ms / self.predicted_ms


class InputError(ValueError):
    pass


def load_points(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: cannot read step times: {exc}") from None
    points = data.get("points") if isinstance(data, dict) else None
    if not isinstance(points, list) or not points:
        raise InputError(f"{path}: no 'points' list (not a gpu_step_times.py output?)")
    required = ("kind", "batch", "new_tokens", "cached_tokens", "median_ms", "gpu_kernel_ms")
    for i, p in enumerate(points):
        missing = [k for k in required if not isinstance(p, dict) or p.get(k) is None]
        if missing:
            raise InputError(f"{path}: points[{i}] lacks {', '.join(missing)}")
    return data.get("meta", {}), points


def build_rows(points: list[dict[str, Any]], profile_name: str) -> list[Row]:
    settings = PredictorSettings(profile=profile_name)
    default = build_instance_predictors(settings)  # what kvgate uses out of the box
    gpu_only = build_instance_predictors(PredictorSettings(profile=profile_name, overhead_ms=0.0))
    rows = []
    for p in points:
        if p["kind"] not in ("prefill", "decode"):
            continue  # mixed steps (bench/gpu_mixed_steps.py): bench/compare_mixed_steps.py
        b, n, c = int(p["batch"]), int(p["new_tokens"]), int(p["cached_tokens"])
        if p["kind"] == "prefill":
            pred = default.prefill.predict(n, c) * 1000.0
            pred_gpu = gpu_only.prefill.predict(n, c) * 1000.0
            adjusted = None
        else:
            pred = default.decode.step_time(b, b * c) * 1000.0
            pred_gpu = gpu_only.decode.step_time(b, b * c) * 1000.0
            cat = p.get("kv_append_kernel_ms")
            adjusted = p["gpu_kernel_ms"] - cat if cat is not None else None
        rows.append(
            Row(p["kind"], b, n, c, p["median_ms"], p["gpu_kernel_ms"], adjusted, pred, pred_gpu)
        )
    return rows


def _mape(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(pred / y - 1.0)) * 100)


def fit_prefill(
    rows: list[Row], field: str, knee: int, *, no_prefix: bool = False
) -> dict[str, Any]:
    pre = [r for r in rows if r.kind == "prefill" and not (no_prefix and r.cached_tokens)]
    n = np.array([r.new_tokens for r in pre], dtype=np.float64)
    c = np.array([r.cached_tokens for r in pre], dtype=np.float64)
    y = np.array([getattr(r, field) for r in pre], dtype=np.float64)
    best = fit_p5(n, c, y)  # knee picked by MAPE
    x = np.stack([np.ones_like(n), np.maximum(n, knee), n * (c + n / 2)], axis=1)
    a, b, g = relative_nnls(x, y)
    return {
        "form": "a + b*max(n, n0) + c*n*(cached + n/2)  [ms]",
        "points": len(pre),
        "best_knee": {
            "a": best.a,
            "b": best.b,
            "n0": best.n0,
            "c": best.c,
            "mape_pct": best.mape_pct,
        },
        "profile_knee": {
            "a": float(a),
            "b": float(b),
            "n0": knee,
            "c": float(g),
            "mape_pct": _mape(x @ np.array([a, b, g]), y),
        },
    }


def fit_decode(rows: list[Row], field: str) -> dict[str, Any]:
    dec = [r for r in rows if r.kind == "decode" and getattr(r, field) is not None]
    batch = np.array([r.batch for r in dec], dtype=np.int64)
    ctx = np.array([r.batch * r.cached_tokens for r in dec], dtype=np.int64)
    secs = np.array([getattr(r, field) / 1000.0 for r in dec], dtype=np.float64)
    model = DecodeStepModel.fit(DecodeSamples(batch, ctx, secs, f"measured {field}"))
    pred = np.array([model.step_time(int(b), int(k)) for b, k in zip(batch, ctx, strict=True)])
    return {
        "form": "a + b*B + k*K  [ms], K = total context tokens of the batch",
        "points": len(dec),
        "a": model.a_ms,
        "b": model.b_ms,
        "k": model.k_ms,
        "mape_pct": _mape(pred, secs),
    }


def fits(rows: list[Row], profile_name: str, e2e: str = "eager") -> dict[str, Any]:
    knee = get_profile(profile_name).prefill.n0
    out = {
        "prefill_kernels": fit_prefill(rows, "kernels_ms", knee),
        # HF runs a prefix prefill through an explicit mask and repeat_kv (gqa_native False in
        # the steps JSON); a paged engine does not, so fit the no-prefix points apart too.
        "prefill_kernels_no_prefix": fit_prefill(rows, "kernels_ms", knee, no_prefix=True),
        f"prefill_{e2e}": fit_prefill(rows, "eager_ms", knee),
        "decode_kernels": fit_decode(rows, "kernels_ms"),
        f"decode_{e2e}": fit_decode(rows, "eager_ms"),
    }
    if any(r.kernels_minus_cat_ms is not None for r in rows):
        out["decode_kernels_minus_cat"] = fit_decode(rows, "kernels_minus_cat_ms")
    return out


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[Row], markdown: bool, e2e: str = "eager") -> str:
    head = [
        "kind",
        "B",
        "n",
        "cached",
        f"{e2e} ms",
        "kernels ms",
        "kernels-cat ms",
        "kvgate ms",
        "profile GPU ms",
        "kernels/GPU",
        "adj/GPU",
        f"{e2e}/kvgate",
    ]
    body = [
        [
            r.kind,
            str(r.batch),
            str(r.new_tokens),
            str(r.cached_tokens),
            _f(r.eager_ms),
            _f(r.kernels_ms),
            _f(r.kernels_minus_cat_ms),
            _f(r.predicted_ms),
            _f(r.predicted_gpu_ms),
            _f(r.gpu_ratio, 2),
            _f(r.adjusted_ratio, 2),
            _f(r.eager_ratio, 2),
        ]
        for r in rows
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join(
        "  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)) for row in [head, *body]
    )


def summary(rows: list[Row]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("prefill", "decode"):
        sel = [r for r in rows if r.kind == kind]
        for name in ("gpu_ratio", "adjusted_ratio", "eager_ratio"):
            vals = np.array([getattr(r, name) for r in sel])
            out[f"{kind}_{name}"] = {
                "median": float(np.median(vals)),
                "min": float(vals.min()),
                "max": float(vals.max()),
            }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_gpu_profile", description=__doc__)
    p.add_argument("--steps", type=Path, default=DEFAULT_STEPS, help="gpu_step_times.py JSON")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="kvgate engine profile name")
    p.add_argument("--json", type=Path, help="write rows, summary and fits here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = p.parse_args(argv)
    try:
        get_profile(a.profile)
        meta, points = load_points(a.steps)
    except (InputError, KeyError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    rows = build_rows(points, a.profile)
    e2e = str(meta.get("e2e_label", "eager"))  # what the steps file's median_ms measured
    result = {
        "e2e_label": e2e,
        "steps_file": str(a.steps),
        "profile": a.profile,
        "device": meta.get("gpu"),
        "software": {k: meta.get(k) for k in ("script", "torch", "transformers", "cuda")},
        "rows": [
            asdict(r)
            | {
                "kernels_over_gpu": r.gpu_ratio,
                "adjusted_over_gpu": r.adjusted_ratio,
                f"{e2e}_over_kvgate": r.eager_ratio,
            }
            for r in rows
        ],
        "summary": summary(rows),
        "fits": fits(rows, a.profile, e2e),
    }
    print(table(rows, a.markdown, e2e))
    print()
    print(json.dumps({"summary": result["summary"], "fits": result["fits"]}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
