"""The loop-stall meter: both modes run the real handler with a real tokenizer and report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import loop_stall
from tests.tiny_model import write_model_dir


def test_both_modes_run_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = write_model_dir(tmp_path / "model")
    out = tmp_path / "stall.json"
    args = ["--model-dir", str(model), "--long", "3", "--doc-chars", "9000", "--gap-ms", "2"]
    assert loop_stall.main([*args, "--rounds", "2", "--short-rate", "500", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["median"]) == {"on_loop", "ahead"}
    for runs in result["runs"].values():
        assert len(runs) == 2
        assert all(r["short_requests"] > 0 and r["long_ms_p50"] > 0 for r in runs)
    assert json.loads(capsys.readouterr().out)["ahead"]["loop_late_ms_max"] >= 0


def test_documents_are_unique_and_about_the_size_asked() -> None:
    docs = [loop_stall.document(i, 5000) for i in range(5)]
    assert len(set(docs)) == 5
    assert all(5000 <= len(d) < 5100 for d in docs)


def test_bad_arguments_exit_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        loop_stall.main(["--model-dir", str(tmp_path)])
    assert exc.value.code == 2 and "tokenizer.json" in capsys.readouterr().err
