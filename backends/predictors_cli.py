"""``kvgate predictors train|eval``: offline training and evaluation of the prefill model.

The gateway CLI owns the top-level parser and calls ``add_arguments(subparsers)``; each handler
is stored as ``func`` in the parsed namespace and returns an exit code. ``python -m
backends.predictors_cli ...`` runs the same commands standalone. It lives at the edge, not in
``predictors/``: it reads and writes files and prints. Expected failures (missing file, bad
row, unknown config/profile, bad model file) print one line to stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import lightgbm as lgb
import numpy as np

from backends.predictor_files import (
    grid_configs,
    load_learned_prefill,
    load_prefill_samples,
    save_prefill_model,
)
from predictors.prefill import AnalyticPrefill
from predictors.prefill_learned import (
    LearnedPrefill,
    holdout_split,
    mape_pct,
    train_prefill_model,
)
from predictors.profiles import get_profile, profile_name_for_config
from predictors.samples import PrefillSamples

EXIT_USAGE = 2
_EXPECTED = (OSError, ValueError, KeyError, lgb.basic.LightGBMError)


def add_arguments(subparsers: Any) -> None:
    """Register ``train`` and ``eval`` on an ``argparse`` subparsers object."""
    train = subparsers.add_parser("train", help="train a learned prefill model and save it")
    train.add_argument("--samples", required=True, help="CSV: calibration grid or observed")
    train.add_argument("--config", help="grid config name, e.g. Llama-3-8B/H100/TP1")
    train.add_argument("--out", required=True, help="model file to write (JSON)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--holdout", type=float, default=0.2, help="held-out fraction")
    train.set_defaults(func=run_train)

    ev = subparsers.add_parser("eval", help="held-out MAPE of learned, compiled and analytic")
    ev.add_argument("--samples", required=True, help="CSV: calibration grid or observed")
    ev.add_argument("--config", help="grid config name")
    ev.add_argument("--model", help="saved model; trains a fresh one when omitted")
    ev.add_argument("--profile", help="profile for the analytic prior (default: from config)")
    ev.add_argument("--all-configs", action="store_true", help="every config in the grid file")
    ev.add_argument("--json", action="store_true", help="machine-readable output")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--holdout", type=float, default=0.2)
    ev.set_defaults(func=run_eval)


def _guarded(body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return body(args)
    except _EXPECTED as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"kvgate predictors: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


def run_train(args: argparse.Namespace) -> int:
    return _guarded(_train, args)


def run_eval(args: argparse.Namespace) -> int:
    return _guarded(_eval, args)


def _train(args: argparse.Namespace) -> int:
    samples = load_prefill_samples(args.samples, args.config)
    model, report = train_prefill_model(samples, seed=args.seed, holdout=args.holdout)
    save_prefill_model(model, args.out)
    r = report
    print(
        f"config={samples.config or '-'} rows={len(samples)} holdout_rows={r.meta.holdout_rows}"
        f" mape_learned={_pct(r.mape_learned_pct)} mape_compiled={_pct(r.mape_compiled_pct)}"
        f" compiled_vs_booster_max={_pct(r.compiled_vs_booster_max_pct)} -> {args.out}"
    )
    return 0


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}%"


def _analytic_mape(
    samples: PrefillSamples, idx: np.ndarray, profile_name: str | None
) -> float | None:
    if profile_name is None:
        return None
    # Grid samples are GPU-only: compare like with like (no engine overhead).
    prior = AnalyticPrefill.from_profile(
        get_profile(profile_name), overhead_ms=None if samples.includes_overhead else 0.0
    )
    pairs = zip(samples.new_tokens[idx].tolist(), samples.cached_tokens[idx].tolist(), strict=True)
    pred = np.array([prior.predict(n, c) for n, c in pairs])
    return mape_pct(pred, samples.seconds[idx])


def evaluate(
    samples: PrefillSamples,
    *,
    model: LearnedPrefill | None = None,
    profile_name: str | None = None,
    seed: int = 0,
    holdout: float = 0.2,
) -> dict[str, Any]:
    """Held-out errors of one model on one sample set (the ``eval --json`` record)."""
    if model is None:
        model, report = train_prefill_model(samples, seed=seed, holdout=holdout)
        idx = report.holdout_index
    elif model.meta.rows == len(samples) and model.meta.config == samples.config:
        # Same data the model was trained on: reproduce its split, score only unseen rows.
        idx = holdout_split(len(samples), model.meta.holdout, model.meta.seed)[1]
    else:
        idx = np.arange(len(samples))  # foreign data: every row is unseen
    if idx.size == 0:
        idx = np.arange(len(samples))
    profile_name = profile_name or profile_name_for_config(samples.config)
    n, c, y = samples.new_tokens[idx], samples.cached_tokens[idx], samples.seconds[idx]
    booster = model.predict_many(n, c)
    pairs = zip(n.tolist(), c.tolist(), strict=True)
    compiled = np.array([model.compiled.predict(a, b) for a, b in pairs])
    return {
        "config": samples.config,
        "rows": len(samples),
        "holdout_rows": int(idx.size),
        "mape_learned_pct": round(mape_pct(booster, y), 4),
        "mape_compiled_pct": round(mape_pct(compiled, y), 4),
        "mape_analytic_pct": _round(_analytic_mape(samples, idx, profile_name)),
        "compiled_vs_booster_max_pct": round(
            float(np.max(np.abs(compiled / booster - 1))) * 100, 4
        ),
        "compiled_vs_booster_offgrid_max_pct": round(_offgrid_disagreement(model, seed), 4),
        "profile": profile_name,
    }


def _offgrid_disagreement(model: LearnedPrefill, seed: int, points: int = 2000) -> float:
    """Max |compiled/booster - 1| in % at random (new, cached) points between the knots:
    held-out grid rows sit on knots, so they cannot show interpolation error."""
    rng = np.random.default_rng(seed)
    n = np.round(np.exp(rng.uniform(np.log(16), np.log(16384), points))).astype(np.int64)
    c = np.round(rng.uniform(0, 24576, points)).astype(np.int64)
    booster = model.predict_many(n, c)
    compiled = np.array([model.compiled.predict(int(a), int(b)) for a, b in zip(n, c, strict=True)])
    return float(np.max(np.abs(compiled / booster - 1))) * 100


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _eval(args: argparse.Namespace) -> int:
    if args.profile is not None:
        get_profile(args.profile)  # fail early with the list of known names
    if args.all_configs:
        if args.model or args.config or args.profile:
            raise ValueError(
                "--all-configs trains one model per config: omit --model/--config/--profile"
            )
        configs = grid_configs(args.samples)
    else:
        configs = [args.config]
    model = load_learned_prefill(args.model) if args.model else None
    results = [
        evaluate(
            load_prefill_samples(args.samples, cfg),
            model=model,
            profile_name=args.profile,
            seed=args.seed,
            holdout=args.holdout,
        )
        for cfg in configs
    ]
    if args.json:
        print(json.dumps(results if args.all_configs else results[0], indent=2))
    else:
        _print_table(results)
    return 0


_COLUMNS = (
    ("config", "config"),
    ("rows", "rows"),
    ("held-out", "holdout_rows"),
    ("learned %", "mape_learned_pct"),
    ("compiled %", "mape_compiled_pct"),
    ("analytic %", "mape_analytic_pct"),
    ("grid-vs-booster %", "compiled_vs_booster_max_pct"),
    ("off-grid %", "compiled_vs_booster_offgrid_max_pct"),
)


def _print_table(results: Sequence[dict[str, Any]]) -> None:
    head = [h for h, _ in _COLUMNS]
    rows = [[_cell(r[k]) for _, k in _COLUMNS] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _cell(v: object) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate predictors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
