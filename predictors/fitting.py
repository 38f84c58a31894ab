"""Offline fitting helpers (numpy): relative least squares, P5 fit, the monotone prefill base.

All fits minimise *relative* error, Σ((pred - y)/y)², like the calibration study (README §2):
step times span three orders of magnitude and an absolute fit would ignore short prompts.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]

# Knee candidates for P5 (README §3: n0 ~ 64-256 on the calibrated GPUs).
_KNEES = (0, 16, 32, 64, 96, 128, 192, 256, 384, 512)


def relative_nnls(x: FloatArray, y: FloatArray) -> FloatArray:
    """Non-negative coefficients minimising relative squared error of ``x @ coef`` vs ``y``.

    Exhaustive over column subsets (fine for the 2-4 term forms used here): physical step-time
    terms cannot be negative, and a negative slope would break monotonicity in tokens.
    """
    rows, cols = x.shape
    xs = x / y[:, None]
    ones = np.ones(rows)
    best: tuple[float, FloatArray] | None = None
    for k in range(cols, 0, -1):
        for keep in itertools.combinations(range(cols), k):
            coef, *_ = np.linalg.lstsq(xs[:, keep], ones, rcond=None)
            if np.any(coef < 0):
                continue
            full = np.zeros(cols)
            full[list(keep)] = coef
            err = float(np.sum((xs @ full - 1.0) ** 2))
            if best is None or err < best[0]:
                best = (err, full)
    return best[1] if best is not None else np.zeros(cols)


@dataclass(frozen=True, slots=True)
class P5Fit:
    a: float
    b: float
    n0: int
    c: float
    mape_pct: float

    def evaluate(self, n: FloatArray, c: FloatArray) -> FloatArray:
        return self.a + self.b * np.maximum(n, self.n0) + self.c * n * (c + n / 2)


def fit_p5(n: FloatArray, c: FloatArray, y: FloatArray) -> P5Fit:
    """P5 ``a + b*max(n, n0) + c*n*(cached + n/2)`` with the knee picked by MAPE."""
    best: P5Fit | None = None
    attn = n * (c + n / 2)
    for knee in _KNEES:
        x = np.stack([np.ones_like(n), np.maximum(n, knee), attn], axis=1)
        a, b, g = relative_nnls(x, y)
        mape = float(np.mean(np.abs(x @ np.array([a, b, g]) / y - 1.0)) * 100)
        if best is None or mape < best.mape_pct:
            best = P5Fit(float(a), float(b), knee, float(g), mape)
    assert best is not None
    return best


def isotonic(values: FloatArray, weights: FloatArray) -> FloatArray:
    """Weighted non-decreasing least-squares fit (pool-adjacent-violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist(), strict=True):
        blocks.append([v, max(w, 1e-300), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, k2 = blocks.pop()
            v1, w1, k1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
    return np.array([v for v, _, k in blocks for _ in range(int(k))], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class MonotoneBase:
    """``h(n) + gamma*n*(cached + n/2)`` with ``h`` non-decreasing, piecewise linear in n.

    This is P5 with the ``a + b*max(n, n0)`` part replaced by a free monotone curve: composed and
    real step times wiggle in n by ±5-20 % (GEMM tiling, README §3 max APE), which P5 cannot follow
    and a monotone-constrained booster on the P5 ratio cannot either (the ratio goes up *and* down).
    ``h`` absorbs the wiggle while staying monotone, so base × monotone booster ratio is monotone.
    Below the first knot h is flat (the knee); beyond the last it grows with P5's per-token slope.
    """

    n_knots: tuple[float, ...]
    h_values: tuple[float, ...]
    gamma: float
    slope_hi: float

    def evaluate(self, n: FloatArray, c: FloatArray) -> FloatArray:
        knots = np.asarray(self.n_knots)
        h = np.interp(n, knots, np.asarray(self.h_values))
        h = h + self.slope_hi * np.maximum(n - knots[-1], 0.0)
        return h + self.gamma * n * (c + n / 2)

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_knots": list(self.n_knots),
            "h_values": list(self.h_values),
            "gamma": self.gamma,
            "slope_hi": self.slope_hi,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MonotoneBase:
        return cls(
            n_knots=tuple(float(v) for v in d["n_knots"]),
            h_values=tuple(float(v) for v in d["h_values"]),
            gamma=float(d["gamma"]),
            slope_hi=float(d["slope_hi"]),
        )


def _hat_basis(n: FloatArray, knots: FloatArray) -> FloatArray:
    """Linear-interpolation weights of each n on the knots (clamped at both ends)."""
    nc = np.clip(n, knots[0], knots[-1])
    basis = np.zeros((n.size, knots.size))
    if knots.size == 1:
        basis[:, 0] = 1.0
        return basis
    i = np.clip(np.searchsorted(knots, nc, side="right") - 1, 0, knots.size - 2)
    t = (nc - knots[i]) / (knots[i + 1] - knots[i])
    rows = np.arange(n.size)
    basis[rows, i] = 1.0 - t
    basis[rows, i + 1] += t
    return basis


def fit_monotone_base(
    n: FloatArray, c: FloatArray, y: FloatArray, *, max_knots: int = 48, iters: int = 10
) -> MonotoneBase:
    """Alternate: h by weighted least squares on a hat basis + isotonic projection, then gamma
    in closed form. Knots are the distinct n values (calibration grids) or, for observed data
    with many distinct lengths, log-quantiles of n."""
    p5 = fit_p5(n, c, y)
    uniq = np.unique(n)
    if uniq.size <= max_knots:
        knots = uniq.astype(np.float64)
    else:
        qs = np.exp(np.quantile(np.log(np.maximum(n, 1.0)), np.linspace(0.0, 1.0, max_knots)))
        knots = np.unique(np.round(qs))
    basis = _hat_basis(n, knots)
    w = 1.0 / (y * y)
    sw = np.sqrt(w)
    attn = n * (c + n / 2)
    extra = p5.b * np.maximum(n - knots[-1], 0.0)
    gamma = p5.c
    h = np.zeros(knots.size)
    for _ in range(iters):
        z = y - gamma * attn - extra
        h, *_ = np.linalg.lstsq(basis * sw[:, None], z * sw, rcond=None)
        h = isotonic(h, (basis * w[:, None]).sum(axis=0))
        rest = y - basis @ h - extra
        denom = float(np.sum(w * attn * attn))
        gamma = max(0.0, float(np.sum(w * attn * rest)) / denom) if denom > 0 else 0.0
    # A positive floor keeps base > 0 (the booster multiplies it); clamping up stays monotone.
    h = np.maximum(h, 1e-9)
    return MonotoneBase(
        n_knots=tuple(knots.tolist()), h_values=tuple(h.tolist()), gamma=gamma, slope_hi=p5.b
    )
