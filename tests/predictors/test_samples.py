from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.predictor_files import grid_configs, load_prefill_samples


def _write(tmp_path: Path, text: str, name: str = "s.csv") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


GRID = """config,n_new,n_cached,gpu_ms
A/H100/TP1,16,0,6.5
A/H100/TP1,32,256,7.0
B/A100/TP8,16,0,20.0
"""


def test_grid_format_filters_config_and_converts_ms_to_seconds(tmp_path: Path) -> None:
    s = load_prefill_samples(_write(tmp_path, GRID), "A/H100/TP1")
    assert len(s) == 2
    assert s.new_tokens.tolist() == [16, 32]
    assert s.cached_tokens.tolist() == [0, 256]
    assert s.seconds == pytest.approx([0.0065, 0.007])
    assert s.config == "A/H100/TP1"
    assert s.includes_overhead is False
    assert s.new_tokens.dtype == np.int64 and s.seconds.dtype == np.float64


def test_grid_single_config_needs_no_filter(tmp_path: Path) -> None:
    s = load_prefill_samples(_write(tmp_path, "config,n_new,n_cached,gpu_ms\nX,1,0,1.0\n"))
    assert s.config == "X" and len(s) == 1


def test_grid_several_configs_require_a_choice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"several configs.*A/H100/TP1.*B/A100/TP8"):
        load_prefill_samples(_write(tmp_path, GRID))


def test_unknown_config_lists_known(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown config 'C'.*A/H100/TP1"):
        load_prefill_samples(_write(tmp_path, GRID), "C")


def test_observed_format(tmp_path: Path) -> None:
    text = "new_tokens,cached_tokens,prefill_s\n100,0,0.01\n\n50.0,2048,0.02\n"
    s = load_prefill_samples(_write(tmp_path, text))
    assert s.new_tokens.tolist() == [100, 50]  # "50.0" accepted, blank line skipped
    assert s.cached_tokens.tolist() == [0, 2048]
    assert s.seconds.tolist() == [0.01, 0.02]
    assert s.config is None and s.includes_overhead is True
    with pytest.raises(ValueError, match="no config column"):
        load_prefill_samples(_write(tmp_path, text), "A")


def test_extra_columns_and_order_are_fine(tmp_path: Path) -> None:
    text = "prefill_s,host,cached_tokens,new_tokens\n0.5,h1,10,20\n"
    s = load_prefill_samples(_write(tmp_path, text))
    assert (s.new_tokens[0], s.cached_tokens[0], s.seconds[0]) == (20, 10, 0.5)


@pytest.mark.parametrize(
    ("body", "line", "what"),
    [
        ("100,0,0.01\n100,x,0.01\n", 3, "cached_tokens='x' is not a number"),
        ("100,0,0.01\n-5,0,0.01\n", 3, "non-negative integer"),
        ("1.5,0,0.01\n", 2, "non-negative integer"),
        ("100,0,0\n", 2, "positive finite time"),
        ("100,0,nan\n", 2, "positive finite time"),
        ("100,0,0.01\n\n100,0\n", 4, "expected 3 fields"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path: Path, body: str, line: int, what: str) -> None:
    p = _write(tmp_path, "new_tokens,cached_tokens,prefill_s\n" + body, "bad.csv")
    with pytest.raises(ValueError) as exc:
        load_prefill_samples(p)
    msg = str(exc.value)
    assert msg.startswith(f"{p}:{line}:"), msg
    assert what in msg


def test_bad_header_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"h\.csv:1: unrecognised header"):
        load_prefill_samples(_write(tmp_path, "a,b,c\n1,2,3\n", "h.csv"))
    with pytest.raises(ValueError, match=r"e\.csv:1: empty file"):
        load_prefill_samples(_write(tmp_path, "", "e.csv"))
    with pytest.raises(ValueError, match="no samples"):
        load_prefill_samples(_write(tmp_path, "new_tokens,cached_tokens,prefill_s\n", "n.csv"))
    with pytest.raises(OSError):
        load_prefill_samples(tmp_path / "missing.csv")


def test_list_configs_and_subset(tmp_path: Path) -> None:
    p = _write(tmp_path, GRID)
    assert grid_configs(p) == ["A/H100/TP1", "B/A100/TP8"]
    s = load_prefill_samples(p, "A/H100/TP1").subset(np.array([1]))
    assert s.new_tokens.tolist() == [32] and s.config == "A/H100/TP1"


def test_real_grid_loads(prefill_grid: Path) -> None:
    assert len(grid_configs(prefill_grid)) == 16
    s = load_prefill_samples(prefill_grid, "Llama-3-8B/H100/TP1")
    assert len(s) == 142
    assert s.seconds[0] == pytest.approx(6.8922e-3)  # first row: 16 new, 0 cached, 6.8922 ms
