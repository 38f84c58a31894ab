"""The prompt-encoding meter runs on a model dir and reports every encoder."""

from __future__ import annotations

import json
from pathlib import Path

from bench import prompt_encode
from tests.tiny_model import write_model_dir


def test_reports_approx_and_exact_encoders(tmp_path: Path, capsys) -> None:
    root = write_model_dir(tmp_path / "m")
    args = ["--model-dir", str(root), "--requests", "6", "--systems", "2", "--reps", "1"]
    assert prompt_encode.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["segment_split_exact"] is True
    for workload in result["workloads"].values():
        assert set(workload["us_per_request"]) == {"approx", "exact_uncached", "exact_cached"}
        assert workload["exact_prompt_tokens_mean"] > 0


def test_a_dir_without_tokenizer_exits_2(tmp_path: Path) -> None:
    assert prompt_encode.main(["--model-dir", str(tmp_path)]) == 2
