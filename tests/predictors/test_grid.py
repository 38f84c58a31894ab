from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.predictor_files import load_compiled, read_model_file
from predictors.grid import (
    GridPrefill,
    default_c_knots,
    default_n_knots,
)
from predictors.prefill import PrefillTimeModel


def _bilinear_grid() -> GridPrefill:
    # f(n, c) = 1 + 2n + 3c + 0.5*n*c is bilinear, so interpolation must be exact inside.
    nk = (1.0, 2.0, 4.0, 8.0)
    ck = (0.0, 10.0, 100.0)
    vals = tuple(tuple(1 + 2 * n + 3 * c + 0.5 * n * c for c in ck) for n in nk)
    return GridPrefill(n_knots=nk, c_knots=ck, values_s=vals)


def _f(n: float, c: float) -> float:
    return 1 + 2 * n + 3 * c + 0.5 * n * c


def test_bilinear_interpolation_is_exact_for_bilinear_function() -> None:
    g = _bilinear_grid()
    for n, c in [(1, 0), (3, 5), (2.5, 55), (7, 99), (8, 100), (4, 10)]:
        assert g.predict(n, c) == pytest.approx(_f(n, c))
    assert isinstance(g, PrefillTimeModel)


def test_outside_the_table() -> None:
    g = _bilinear_grid()
    assert g.predict(0, 5) == pytest.approx(_f(1, 5))  # below first n knot: clamped
    # Beyond the last n knot: linear in n with the last segment's slope.
    slope = (_f(8, 50) - _f(4, 50)) / 4
    assert g.predict(20, 50) == pytest.approx(_f(8, 50) + 12 * slope)
    # Beyond the last cached knot: clamped (keeps monotonicity in n).
    assert g.predict(5, 1000) == pytest.approx(_f(5, 100))


def test_overhead_is_added() -> None:
    g = _bilinear_grid().with_overhead(0.25)
    assert g.predict(3, 5) == pytest.approx(_f(3, 5) + 0.25)
    assert _bilinear_grid().overhead_s == 0.0


def test_validation() -> None:
    with pytest.raises(ValueError):
        GridPrefill(n_knots=(1.0,), c_knots=(0.0, 1.0), values_s=((1.0, 1.0),))
    with pytest.raises(ValueError):
        GridPrefill(n_knots=(2.0, 1.0), c_knots=(0.0, 1.0), values_s=((1.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError):
        GridPrefill(n_knots=(1.0, 2.0), c_knots=(0.0, 1.0), values_s=((1.0, 1.0),))
    with pytest.raises(ValueError):
        GridPrefill(n_knots=(1.0, 2.0), c_knots=(0.0, 1.0), values_s=((1.0, -1.0), (1.0, 1.0)))
    with pytest.raises(ValueError):
        GridPrefill(
            n_knots=(1.0, 2.0), c_knots=(0.0, 1.0), values_s=((1.0, 1.0), (1.0, 1.0)), overhead_s=-1
        )


def test_dict_round_trip() -> None:
    g = _bilinear_grid().with_overhead(0.1)
    assert GridPrefill.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_default_knots_cover_ranges() -> None:
    nk, ck = default_n_knots(), default_c_knots()
    assert nk[0] == 1 and nk[-1] == 65536
    assert ck[0] == 0 and ck[-1] == 131072
    big = [k for k in nk if k >= 64]  # small knots are integer-rounded, so coarser
    assert max(b / a for a, b in pairwise(big)) < 1.1
    assert 3000.0 in default_n_knots([3000, 1e9])  # extra inside range kept, outside dropped
    assert 1e9 not in default_n_knots([1e9])


@st.composite
def monotone_tables(draw: st.DrawFn) -> GridPrefill:
    nk = sorted(set(draw(st.lists(st.integers(1, 5000), min_size=2, max_size=8))))
    ck = sorted(set(draw(st.lists(st.integers(0, 5000), min_size=2, max_size=6))))
    if len(nk) < 2 or len(ck) < 2:
        nk, ck = [1, 2], [0, 1]
    cols = []
    for _ in ck:
        steps = draw(st.lists(st.floats(0, 10), min_size=len(nk), max_size=len(nk)))
        acc, col = 0.001, []
        for s in steps:
            acc += s
            col.append(acc)
        cols.append(col)
    vals = tuple(tuple(cols[j][i] for j in range(len(ck))) for i in range(len(nk)))
    return GridPrefill(tuple(map(float, nk)), tuple(map(float, ck)), vals)


@given(
    g=monotone_tables(),
    n1=st.integers(0, 20_000),
    n2=st.integers(0, 20_000),
    c=st.integers(0, 20_000),
)
def test_monotone_table_gives_monotone_predictions(
    g: GridPrefill, n1: int, n2: int, c: int
) -> None:
    assert g.is_monotone_in_new_tokens()
    lo, hi = sorted((n1, n2))
    # Bilinear interpolation over equal knot values rounds by a few 1e-12 (found by
    # hypothesis: 0.001 vs 0.0009999999999977); monotone up to that.
    assert g.predict(lo, c) <= g.predict(hi, c) * (1 + 1e-9)


def test_read_model_file_rejects_foreign_files(tmp_path: Path) -> None:
    bad_json = tmp_path / "a.json"
    bad_json.write_text("not json")
    with pytest.raises(ValueError, match="not a kvgate prefill model"):
        read_model_file(bad_json)
    other = tmp_path / "b.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="format"):
        read_model_file(other)
    old = tmp_path / "c.json"
    old.write_text(json.dumps({"format": "kvgate.learned_prefill", "format_version": 99}))
    with pytest.raises(ValueError, match="format_version"):
        load_compiled(old)
    with pytest.raises(OSError):
        read_model_file(tmp_path / "missing.json")
