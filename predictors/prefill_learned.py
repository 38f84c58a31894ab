"""Learned prefill model: monotone base × LightGBM residual ratio, compiled to a ``GridPrefill``.

Design (chosen by held-out MAPE on the calibration grids, see ``TrainReport``):

* ``time = base(n, c) * exp(g(n, c))``; ``base`` is P5 with a free non-decreasing curve in n
  (``fitting.MonotoneBase``) and ``g`` a LightGBM L2 regressor on ``log(time / base)``. A
  log-ratio target makes L2 a relative-error loss, and trees are piecewise constant, so learning
  the ratio to a smooth base (rather than log time itself) avoids step errors between sizes.
* Monotone constraint +1 on ``n_new`` and ``attn = n*(c + n/2)`` (both grow with n at fixed c),
  so base and ratio are non-decreasing in n and so is their product. (A constrained ratio to
  plain P5 scored ~2.8 % mean / 5.9 % worst MAPE; with the monotone base: ~0.3 % / <1 %.)
* The request path never calls the booster: ``compiled`` is a ``GridPrefill`` evaluated once
  with a single vectorised ``booster.predict``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import lightgbm as lgb
import numpy as np
from numpy.typing import NDArray

from predictors.fitting import FloatArray, MonotoneBase, fit_monotone_base
from predictors.grid import (
    MODEL_FORMAT,
    MODEL_FORMAT_VERSION,
    GridPrefill,
    check_model_doc,
    default_c_knots,
    default_n_knots,
)
from predictors.profiles import profile_name_for_config
from predictors.samples import PrefillSamples

FEATURES: tuple[str, ...] = ("n_new", "n_cached", "attn")
MONOTONE: tuple[int, ...] = (1, 0, 1)
CREATED_BY = f"kvgate.predictors/{MODEL_FORMAT_VERSION} lightgbm/{lgb.__version__}"
_ROUNDS = 300
_MIN_ROWS = 8


def features(n: FloatArray, c: FloatArray) -> FloatArray:
    return np.stack([n, c, n * (c + n / 2)], axis=1)


def mape_pct(pred: FloatArray, actual: FloatArray) -> float:
    return float(np.mean(np.abs(pred / actual - 1.0)) * 100.0)


def holdout_split(
    rows: int, holdout: float, seed: int
) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """Deterministic (train, held-out) row indices; eval reproduces it from the model metadata."""
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    perm = np.random.default_rng(seed).permutation(rows)
    k = round(holdout * rows)
    return np.sort(perm[k:]), np.sort(perm[:k])


@dataclass(frozen=True)
class TrainingMeta:
    config: str | None
    profile: str | None
    source: str
    rows: int
    train_rows: int
    holdout_rows: int
    seed: int
    holdout: float
    holdout_mape_pct: float | None
    includes_overhead: bool  # False: GPU-only samples, the runtime adds per-step overhead
    created_by: str = CREATED_BY


@dataclass(frozen=True, eq=False)  # numpy arrays inside: identity equality
class TrainReport:
    meta: TrainingMeta
    mape_learned_pct: float | None  # base × booster, held-out rows
    mape_compiled_pct: float | None  # GridPrefill, held-out rows
    mape_base_pct: float | None  # monotone base alone, held-out rows
    compiled_vs_booster_max_pct: float | None
    holdout_index: NDArray[np.int64]


@dataclass(frozen=True, eq=False)  # a Booster has no value equality
class LearnedPrefill:
    booster: lgb.Booster
    base: MonotoneBase
    meta: TrainingMeta
    compiled: GridPrefill
    features: tuple[str, ...] = FEATURES

    def predict_many(self, new_tokens: NDArray[Any], cached_tokens: NDArray[Any]) -> FloatArray:
        """Seconds via the booster (offline/eval path), GPU-only like the training samples."""
        n = np.asarray(new_tokens, dtype=np.float64)
        c = np.asarray(cached_tokens, dtype=np.float64)
        ratio = np.exp(self.booster.predict(features(n, c), num_threads=1))
        return self.base.evaluate(n, c) * ratio

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        """Booster path, ~0.3 ms: for offline use; serve with ``compiled`` instead."""
        return float(self.predict_many(np.array([new_tokens]), np.array([cached_tokens]))[0])

    def to_doc(self) -> dict[str, Any]:
        """The model file's document (JSON-ready; ``backends.predictor_files`` writes it)."""
        return {
            "format": MODEL_FORMAT,
            "format_version": MODEL_FORMAT_VERSION,
            "features": list(self.features),
            "monotone_constraints": list(MONOTONE),
            "target": "log(seconds / base(n_new, n_cached))",
            "base": self.base.to_dict(),
            "meta": asdict(self.meta),
            "grid": self.compiled.to_dict(),
            "booster": self.booster.model_to_string(),
        }

    @classmethod
    def from_doc(cls, doc: Any, source: str) -> LearnedPrefill:
        """The inverse of ``to_doc``; ``source`` names the file in errors."""
        doc = check_model_doc(doc, source)
        try:
            meta = TrainingMeta(**doc["meta"])
            feats = tuple(doc["features"])
            base = MonotoneBase.from_dict(doc["base"])
            grid = GridPrefill.from_dict(doc["grid"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: malformed model file: {exc}") from None
        if feats != FEATURES:
            raise ValueError(f"{source}: model features {feats} != supported {FEATURES}")
        booster = lgb.Booster(model_str=doc["booster"])
        return cls(booster=booster, base=base, meta=meta, compiled=grid, features=feats)


def _file_name(source: str) -> str:
    """The last component of a path, as metadata (no filesystem access: the core does no I/O)."""
    return source.replace("\\", "/").rsplit("/", 1)[-1]


def _booster_params(seed: int) -> dict[str, Any]:
    return {
        "objective": "regression",
        "learning_rate": 0.05,
        "num_leaves": 7,
        "min_data_in_leaf": 5,
        "lambda_l2": 1.0,
        "monotone_constraints": list(MONOTONE),
        "num_threads": 1,  # tiny data: threads only add overhead and non-determinism
        "deterministic": True,
        "seed": seed,
        "verbose": -1,
    }


def split_knots(booster: lgb.Booster, feature: int, limit: int = 64) -> list[float]:
    """Integer knots bracketing the booster's split thresholds on one feature.

    A split ``x <= t`` is a step between floor(t) and floor(t) + 1 for integer token counts;
    knots on both sides make the table reproduce the step instead of smearing it over a whole
    knot interval (that smearing cost up to ~1 % next to cached-length splits). Skipped when
    there are more than ``limit`` distinct thresholds (large observed data sets)."""
    found: set[float] = set()
    stack = [t["tree_structure"] for t in booster.dump_model()["tree_info"]]
    while stack:
        node = stack.pop()
        if "split_feature" in node:
            if node["split_feature"] == feature:
                found.add(float(node["threshold"]))
            stack.extend((node["left_child"], node["right_child"]))
    if len(found) > limit:
        return []
    return sorted({float(np.floor(t)) + k for t in found for k in (0.0, 1.0)})


def compile_grid(
    booster: lgb.Booster, base: MonotoneBase, n_support: FloatArray, c_support: FloatArray
) -> GridPrefill:
    """Evaluate base × booster on the knot mesh with one vectorised ``predict``.

    Knots = log ladder + the booster's split points + the sample support when small
    (calibration grids): the base has kinks exactly there. Splits on ``attn`` are curves in
    (n, c) and cannot be aligned with knots; they are small steps between dense knots."""
    n_extra = split_knots(booster, 0)
    c_extra = split_knots(booster, 1)
    for support, extra in ((n_support, n_extra), (c_support, c_extra)):
        uniq = np.unique(support)
        if uniq.size <= 64:
            extra.extend(uniq.tolist())
    nk = np.array(default_n_knots(n_extra))
    ck = np.array(default_c_knots(c_extra))
    nn, cc = np.meshgrid(nk, ck, indexing="ij")
    n, c = nn.ravel(), cc.ravel()
    vals = base.evaluate(n, c) * np.exp(booster.predict(features(n, c), num_threads=1))
    table = vals.reshape(nk.size, ck.size)
    return GridPrefill(
        n_knots=tuple(nk.tolist()),
        c_knots=tuple(ck.tolist()),
        values_s=tuple(tuple(row) for row in table.tolist()),
    )


def train_prefill_model(
    samples: PrefillSamples, *, seed: int = 0, holdout: float = 0.2
) -> tuple[LearnedPrefill, TrainReport]:
    """Fit base and booster on a random ``1 - holdout`` of the rows; report held-out errors."""
    rows = len(samples)
    train_idx, test_idx = holdout_split(rows, holdout, seed)
    if train_idx.size < _MIN_ROWS:
        raise ValueError(f"need at least {_MIN_ROWS} training rows, have {train_idx.size}")
    n = samples.new_tokens.astype(np.float64)
    c = samples.cached_tokens.astype(np.float64)
    y = samples.seconds
    base = fit_monotone_base(n[train_idx], c[train_idx], y[train_idx])
    x = features(n, c)
    target = np.log(y / base.evaluate(n, c))
    # min_data_in_bin=1: calibration grids have ~100 rows, the default (3) merges distinct sizes.
    data = lgb.Dataset(
        x[train_idx], target[train_idx], feature_name=list(FEATURES),
        params={"min_data_in_bin": 1, "verbose": -1},
    )  # fmt: skip
    booster = lgb.train(_booster_params(seed), data, num_boost_round=_ROUNDS)
    compiled = compile_grid(booster, base, n[train_idx], c[train_idx])

    learned = mape_c = mape_b = agree = None
    if test_idx.size:
        nt, ct, yt = n[test_idx], c[test_idx], y[test_idx]
        pred = base.evaluate(nt, ct) * np.exp(booster.predict(x[test_idx], num_threads=1))
        comp = np.array([compiled.predict(a, b) for a, b in zip(nt, ct, strict=True)])
        learned, mape_c = mape_pct(pred, yt), mape_pct(comp, yt)
        mape_b = mape_pct(base.evaluate(nt, ct), yt)
        agree = float(np.max(np.abs(comp / pred - 1.0)) * 100.0)
    meta = TrainingMeta(
        config=samples.config,
        profile=profile_name_for_config(samples.config),
        source=_file_name(samples.source),
        rows=rows,
        train_rows=int(train_idx.size),
        holdout_rows=int(test_idx.size),
        seed=seed,
        holdout=holdout,
        holdout_mape_pct=learned,
        includes_overhead=samples.includes_overhead,
    )
    model = LearnedPrefill(booster=booster, base=base, meta=meta, compiled=compiled)
    return model, TrainReport(meta, learned, mape_c, mape_b, agree, test_idx)
