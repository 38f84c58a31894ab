"""Timing samples from CSV (offline only: training, eval, tests).

Two prefill formats, told apart by the header:

* calibration grid: ``config,n_new,n_cached,gpu_ms`` — composed GPU time, no engine overhead;
* kvgate observed: ``new_tokens,cached_tokens,prefill_s`` — measured, overhead included.

Any bad row raises ``ValueError("<file>:<line>: <reason>")``; times are returned in seconds.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

GRID_PREFILL_COLUMNS = ("config", "n_new", "n_cached", "gpu_ms")
OBSERVED_PREFILL_COLUMNS = ("new_tokens", "cached_tokens", "prefill_s")


@dataclass(frozen=True)
class CsvRecord:
    line: int
    values: dict[str, str]


def read_csv_records(
    path: str | Path, formats: Sequence[Sequence[str]]
) -> tuple[int, list[CsvRecord]]:
    """Open ``path``, match its header against ``formats`` and return (format index, records).

    Records are read eagerly (the files are small) so the file is closed on return. Missing files
    raise ``OSError``; callers (the CLI) report it like a bad row.
    """
    p = Path(path)
    with p.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{p}:1: empty file")
        names = [h.strip() for h in header]
        fmt = next((i for i, f in enumerate(formats) if set(f) <= set(names)), None)
        if fmt is None:
            wanted = " or ".join(",".join(f) for f in formats)
            raise ValueError(f"{p}:1: unrecognised header {','.join(names)!r}; expected {wanted}")
        records: list[CsvRecord] = []
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(names):
                raise ValueError(f"{p}:{line}: expected {len(names)} fields, got {len(row)}")
            records.append(CsvRecord(line, {k: v.strip() for k, v in zip(names, row, strict=True)}))
    return fmt, records


def parse_count(path: str | Path, rec: CsvRecord, column: str) -> int:
    """A non-negative integer token/batch count ("16" and "16.0" both accepted)."""
    raw = rec.values[column]
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or not v.is_integer():
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} must be a non-negative integer")
    return int(v)


def parse_time(path: str | Path, rec: CsvRecord, column: str) -> float:
    """A strictly positive, finite duration (in the column's own unit)."""
    raw = rec.values[column]
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} must be a positive finite time")
    return v


@dataclass(frozen=True, eq=False)  # numpy arrays inside: identity equality
class PrefillSamples:
    new_tokens: NDArray[np.int64]
    cached_tokens: NDArray[np.int64]
    seconds: NDArray[np.float64]
    source: str
    config: str | None = None
    # False for calibration grids (GPU time only): consumers add the engine overhead themselves.
    includes_overhead: bool = True

    def __post_init__(self) -> None:
        if not (len(self.new_tokens) == len(self.cached_tokens) == len(self.seconds)):
            raise ValueError("new_tokens, cached_tokens and seconds must have the same length")

    def __len__(self) -> int:
        return len(self.seconds)

    def subset(self, idx: NDArray[np.int64]) -> PrefillSamples:
        return PrefillSamples(
            self.new_tokens[idx],
            self.cached_tokens[idx],
            self.seconds[idx],
            self.source,
            self.config,
            self.includes_overhead,
        )


def select_config(path: str | Path, found: Sequence[str], config: str | None) -> str:
    """Validate the ``--config`` choice against the configs present in a grid file."""
    known = sorted(set(found))
    if config is None:
        if len(known) == 1:
            return known[0]
        raise ValueError(f"{path}: file holds several configs, choose one of: {', '.join(known)}")
    if config not in known:
        raise ValueError(f"{path}: unknown config {config!r}; known: {', '.join(known)}")
    return config


def list_configs(path: str | Path) -> list[str]:
    """Configs present in a calibration grid file, in first-seen order."""
    _, records = read_csv_records(path, (("config",),))
    return list(dict.fromkeys(r.values["config"] for r in records))


def load_prefill_samples(path: str | Path, config: str | None = None) -> PrefillSamples:
    fmt, recs = read_csv_records(path, (GRID_PREFILL_COLUMNS, OBSERVED_PREFILL_COLUMNS))
    if fmt == 0:
        chosen = select_config(path, [r.values["config"] for r in recs], config)
        recs = [r for r in recs if r.values["config"] == chosen]
        cols, scale, overhead = ("n_new", "n_cached", "gpu_ms"), 1e-3, False
    else:
        if config is not None:
            raise ValueError(
                f"{path}: config filter {config!r} given but file has no config column"
            )
        chosen, cols, scale, overhead = None, OBSERVED_PREFILL_COLUMNS, 1.0, True
    if not recs:
        raise ValueError(f"{path}: no samples")
    new = np.array([parse_count(path, r, cols[0]) for r in recs], dtype=np.int64)
    cached = np.array([parse_count(path, r, cols[1]) for r in recs], dtype=np.int64)
    secs = np.array([parse_time(path, r, cols[2]) * scale for r in recs], dtype=np.float64)
    return PrefillSamples(new, cached, secs, str(path), chosen, overhead)
