"""``GridPrefill``: a learned prefill model compiled to a 2-D table, evaluated in pure Python.

A LightGBM ``predict`` call costs ~270 µs; routing needs a prefill time per (request, candidate,
cached length). So the trained model is evaluated once on log-spaced knots over (new, cached)
and requests are answered by bilinear interpolation: two ``bisect``s and ~15 float operations.

Outside the table: below the first knot the value is clamped (n = 0 costs what n = 1 does — a
full prefix hit still runs a forward step); beyond the last n knot time grows linearly in n with
the last segment's slope; beyond the last cached knot (131072, past every profile's context) it
is clamped, because extrapolating bilinear weights there could break monotonicity in n.
Monotonicity: if the table is non-decreasing along n for every cached knot, every prediction is
too (a convex combination of piecewise-linear non-decreasing functions).

This module also owns checking a model file's document (parsed JSON, read by
``backends.predictor_files``), so the runtime can load a compiled model without importing
LightGBM.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

MODEL_FORMAT = "kvgate.learned_prefill"
MODEL_FORMAT_VERSION = 1


def default_n_knots(extra: Sequence[float] = ()) -> tuple[float, ...]:
    """1 .. 65536 at 2^(1/8) steps (≤ 9 % apart: linear interpolation of the n² attention term
    then errs < 0.1 %), plus ``extra`` (e.g. the sample support, where the model has kinks)."""
    ladder = {float(round(2 ** (k / 8))) for k in range(0, 129)}
    return tuple(sorted(ladder | {float(v) for v in extra if 1 <= v <= 65536}))


def default_c_knots(extra: Sequence[float] = ()) -> tuple[float, ...]:
    """0, then 16 .. 131072 at 2^(1/4) steps; time is linear in the cached length, so coarser."""
    ladder = {0.0} | {float(round(2 ** (k / 4))) for k in range(16, 69)}
    return tuple(sorted(ladder | {float(v) for v in extra if 0 <= v <= 131072}))


@dataclass(frozen=True, slots=True)
class GridPrefill:
    """Table ``values_s[i][j]`` = seconds for ``n_knots[i]`` new and ``c_knots[j]`` cached
    tokens, plus a constant ``overhead_s`` (engine per-step overhead when the table is GPU-only).
    """

    n_knots: tuple[float, ...]
    c_knots: tuple[float, ...]
    values_s: tuple[tuple[float, ...], ...]
    overhead_s: float = 0.0
    # Precomputed for the hot path (inverse segment widths, last segment index).
    _n_inv: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _c_inv: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _n_last: int = field(init=False, repr=False, compare=False)
    _c_last: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, knots in (("n_knots", self.n_knots), ("c_knots", self.c_knots)):
            if len(knots) < 2 or any(b <= a for a, b in pairwise(knots)):
                raise ValueError(f"{name} must have >= 2 strictly increasing values")
            if knots[0] < 0:
                raise ValueError(f"{name} must be >= 0")
        if len(self.values_s) != len(self.n_knots) or any(
            len(row) != len(self.c_knots) for row in self.values_s
        ):
            raise ValueError("values_s must have shape (len(n_knots), len(c_knots))")
        if not all(math.isfinite(v) and v > 0 for row in self.values_s for v in row):
            raise ValueError("values_s must be positive and finite")
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise ValueError("overhead_s must be >= 0")
        nk, ck = self.n_knots, self.c_knots
        object.__setattr__(self, "_n_inv", tuple(1.0 / (b - a) for a, b in pairwise(nk)))
        object.__setattr__(self, "_c_inv", tuple(1.0 / (b - a) for a, b in pairwise(ck)))
        object.__setattr__(self, "_n_last", len(nk) - 2)
        object.__setattr__(self, "_c_last", len(ck) - 2)

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        nk = self.n_knots
        i = bisect_right(nk, new_tokens) - 1
        if i < 0:
            i, t = 0, 0.0
        else:
            if i > self._n_last:
                i = self._n_last  # t > 1: linear extrapolation along the last segment
            t = (new_tokens - nk[i]) * self._n_inv[i]
        ck = self.c_knots
        j = bisect_right(ck, cached_tokens) - 1
        if j < 0:
            j, u = 0, 0.0
        elif j > self._c_last:
            j, u = self._c_last, 1.0
        else:
            u = (cached_tokens - ck[j]) * self._c_inv[j]
        r0 = self.values_s[i]
        r1 = self.values_s[i + 1]
        # a + t*(b - a) (not (1-t)*a + t*b) keeps equal neighbours exactly equal: no ulp wobble.
        lo = r0[j] + t * (r1[j] - r0[j])
        hi = r0[j + 1] + t * (r1[j + 1] - r0[j + 1])
        return lo + u * (hi - lo) + self.overhead_s

    def with_overhead(self, overhead_s: float) -> GridPrefill:
        return replace(self, overhead_s=overhead_s)

    def is_monotone_in_new_tokens(self) -> bool:
        return all(
            self.values_s[i + 1][j] >= self.values_s[i][j]
            for i in range(len(self.n_knots) - 1)
            for j in range(len(self.c_knots))
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_knots": list(self.n_knots),
            "c_knots": list(self.c_knots),
            "values_s": [list(row) for row in self.values_s],
            "overhead_s": self.overhead_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GridPrefill:
        return cls(
            n_knots=tuple(float(v) for v in d["n_knots"]),
            c_knots=tuple(float(v) for v in d["c_knots"]),
            values_s=tuple(tuple(float(v) for v in row) for row in d["values_s"]),
            overhead_s=float(d.get("overhead_s", 0.0)),
        )


def check_model_doc(doc: Any, source: str) -> dict[str, Any]:
    """Sanity-check the parsed document of a model file written for ``LearnedPrefill``."""
    if not isinstance(doc, dict) or doc.get("format") != MODEL_FORMAT:
        raise ValueError(f"{source}: not a kvgate prefill model file (format != {MODEL_FORMAT!r})")
    if doc.get("format_version") != MODEL_FORMAT_VERSION:
        raise ValueError(
            f"{source}: unsupported model format_version {doc.get('format_version')!r}"
        )
    for key in ("grid", "meta", "booster", "base", "features"):
        if key not in doc:
            raise ValueError(f"{source}: model file lacks {key!r}")
    return doc


@dataclass(frozen=True)
class SavedPrefill:
    """A saved model's compiled table and training metadata (what serving needs)."""

    grid: GridPrefill
    meta: dict[str, Any]
    source: str


def compiled_from_doc(doc: Any, source: str) -> SavedPrefill:
    """The compiled table and training metadata of a model document, without LightGBM."""
    doc = check_model_doc(doc, source)
    try:
        grid = GridPrefill.from_dict(doc["grid"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: bad compiled grid: {exc}") from None
    return SavedPrefill(grid, dict(doc["meta"]), source)
