"""Shared test data for predictors tests: calibration file locations and synthetic samples."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from predictors.profiles import get_profile
from predictors.samples import PrefillSamples

RESULTS = Path(os.environ.get("KVGATE_CALIBRATION_RESULTS", "/work/shared/calibration/results"))
PREFILL_GRID = RESULTS / "composed_prefill_grid.csv"
DECODE_GRID = RESULTS / "composed_decode_grid.csv"
FIT_RESULTS = RESULTS / "fit_results.json"
TARGET_CONFIGS = ("Llama-3-8B/H100/TP1", "Llama-2-70B/A100/TP8")


N_LADDER = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192, 16384)
C_LADDER = (0, 256, 1024, 4096, 8192, 16384)


def synthetic_rows(profile_name: str = "llama3-8b-h100-tp1") -> list[tuple[int, int, float]]:
    """(n_new, n_cached, gpu_ms) from the profile's P5 times a deterministic ±4 % wiggle in n,
    like the kernel-tiling wiggle of the composed grid: no calibration file needed."""
    p5 = get_profile(profile_name).prefill
    return [
        (n, c, p5.gpu_ms(n, c) * (1.0 + 0.04 * math.sin(1.7 * math.log2(n))))
        for n in N_LADDER
        for c in C_LADDER
    ]


def write_grid_csv(path: Path, configs: dict[str, str]) -> Path:
    """Calibration-format prefill CSV with one synthetic block per {config: profile name}."""
    lines = ["config,n_new,n_cached,gpu_ms"]
    for cfg, prof in configs.items():
        lines += [f"{cfg},{n},{c},{ms:.6f}" for n, c, ms in synthetic_rows(prof)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def synthetic_samples(config: str | None = "Llama-3-8B/H100/TP1") -> PrefillSamples:
    rows = np.array(synthetic_rows(), dtype=np.float64)
    return PrefillSamples(
        new_tokens=rows[:, 0].astype(np.int64),
        cached_tokens=rows[:, 1].astype(np.int64),
        seconds=rows[:, 2] / 1000.0,
        source="synthetic",
        config=config,
        includes_overhead=config is None,
    )
