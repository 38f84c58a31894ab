"""bench/lora_affinity.py: its workload, and one tiny round end to end on emulators."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from bench import lora_affinity


def _args(*argv: str) -> argparse.Namespace:
    return lora_affinity.parser().parse_args(["--requests", "200", "--zipf", "1.0", *argv])


def test_the_workload_is_seeded_and_skewed_to_the_first_adapters() -> None:
    a, b = lora_affinity.workload(_args()), lora_affinity.workload(_args())
    assert a == b and len(a) == 200
    counts = Counter(r["model"] for r in a)
    assert counts["lora0"] > counts["lora3"] > 0  # Zipf 1.0 over four adapters
    assert all(16 <= r["max_tokens"] <= 256 and r["stream"] for r in a)
    assert len({r["prompt"] for r in a}) == 200  # unique prompts: no prefix to steer placement


def test_one_round_reports_both_runs_and_their_ratio(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    argv = ["--instances", "2", "--adapters", "3", "--requests", "12", "--concurrency", "3"]
    argv += ["--max-tokens", "24", "--time-scale", "0.2", "--rounds", "1", "--json", str(out)]
    assert lora_affinity.main(argv) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["lora_affinity"] for r in runs] == [True, False]
    assert all(r["requests"] == 12 and sum(r["split"].values()) == 12 for r in runs)
    assert runs[0]["lora_load"]["cold_samples"] >= 1  # each adapter's first request is cold
    assert runs[1]["lora_load"]["cold_samples"] == 0  # affinity off: nothing weighed
    ratio = report["on_over_off"]["ttft_mean_s"]
    assert ratio["per_round"] == [round(runs[0]["ttft_mean_s"] / runs[1]["ttft_mean_s"], 4)]
    assert ratio["median"] == ratio["per_round"][0]


@pytest.mark.parametrize("variants", ["on", "on,bogus,off", "on,on_no_load"])
def test_variants_must_name_off_and_another_known_one(
    variants: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        lora_affinity.main(["--variants", variants])
    assert exc.value.code == 2
    assert "--variants" in capsys.readouterr().err
