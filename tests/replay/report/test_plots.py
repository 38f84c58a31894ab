from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from replay.report import plots
from replay.report.results import Outcome, RequestOutcome
from tests.replay.report.test_report import empty_run, sample_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG file, checking the signature and IHDR chunk."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.stat().st_size > 5_000  # more than an empty canvas
    w, h = png_size(path)
    assert (w, h) == (800, 600)  # 8x6 in at 100 dpi


def test_ttft_cdf(tmp_path: Path) -> None:
    runs = [sample_run("a"), sample_run("b")]
    out = plots.plot_ttft_cdf(runs, tmp_path / "sub" / "ttft.png")
    assert out == tmp_path / "sub" / "ttft.png"
    assert_png(out)


def test_ttft_cdf_log_range_and_empty(tmp_path: Path) -> None:
    run = sample_run("wide")
    run.requests.append(
        RequestOutcome("x", 1.0, 10, 10, Outcome.COMPLETED, ttft_s=0.001, tbt_mean_s=0.01)
    )
    assert_png(plots.plot_ttft_cdf([run], tmp_path / "wide.png"))
    assert_png(plots.plot_ttft_cdf([empty_run()], tmp_path / "empty.png"))


def test_plot_load(tmp_path: Path) -> None:
    assert_png(plots.plot_load(sample_run(), tmp_path / "load.png", bucket_s=5.0))
    assert_png(plots.plot_load(empty_run(), tmp_path / "empty_load.png"))


def test_plot_load_comparison(tmp_path: Path) -> None:
    runs = [sample_run("early"), sample_run("predictive"), empty_run()]
    assert_png(plots.plot_load_comparison(runs, tmp_path / "cmp.png"))


def test_write_plots_names(tmp_path: Path) -> None:
    runs = [
        sample_run("kvcache_centric+early"),
        sample_run("kvcache_centric+predictive"),
        sample_run("kvcache_centric+predictive"),
        sample_run("../weird label/"),
    ]
    paths = plots.write_plots(runs, tmp_path / "plots")
    names = [p.name for p in paths]
    assert names == [
        "ttft_cdf.png",
        "load_kvcache_centric_early.png",
        "load_kvcache_centric_predictive.png",
        "load_kvcache_centric_predictive_2.png",
        "load_weird_label.png",
        "load_comparison.png",
    ]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    for p in paths:
        assert_png(p)


def test_write_plots_single_run_has_no_comparison(tmp_path: Path) -> None:
    names = [p.name for p in plots.write_plots([sample_run("solo")], tmp_path)]
    assert names == ["ttft_cdf.png", "load_solo.png"]


def test_safe_name() -> None:
    assert plots.safe_name("a+b c") == "a_b_c"
    assert plots.safe_name("///") == "run"
    assert plots.safe_name("x-1.5") == "x-1.5"


def test_missing_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(RuntimeError, match=r"kvgate\[plots\]"):
        plots.plot_ttft_cdf([sample_run()], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
