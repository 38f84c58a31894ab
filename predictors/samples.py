"""Timing samples parsed from CSV text (offline only: training, eval, tests).

Two formats per phase, told apart by the header:

* calibration grid: ``config,...,gpu_ms`` — composed GPU time, no engine overhead;
* kvgate observed: ``...,prefill_s`` / ``...,step_s`` — measured, overhead included.

The text comes from the edge (``backends.predictor_files`` reads the file); ``source`` names it
in errors. Any bad row raises ``ValueError("<source>:<line>: <reason>")``; times are returned in
seconds.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

GRID_PREFILL_COLUMNS = ("config", "n_new", "n_cached", "gpu_ms")
OBSERVED_PREFILL_COLUMNS = ("new_tokens", "cached_tokens", "prefill_s")


@dataclass(frozen=True)
class CsvRecord:
    line: int
    values: dict[str, str]


def parse_csv_records(
    lines: Iterable[str], source: str, formats: Sequence[Sequence[str]]
) -> tuple[int, list[CsvRecord]]:
    """Match the header of ``lines`` (CSV text, e.g. ``text.splitlines(keepends=True)``)
    against ``formats`` and return (format index, records)."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{source}:1: empty file")
    names = [h.strip() for h in header]
    fmt = next((i for i, f in enumerate(formats) if set(f) <= set(names)), None)
    if fmt is None:
        wanted = " or ".join(",".join(f) for f in formats)
        raise ValueError(f"{source}:1: unrecognised header {','.join(names)!r}; expected {wanted}")
    records: list[CsvRecord] = []
    for row in reader:
        line = reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(names):
            raise ValueError(f"{source}:{line}: expected {len(names)} fields, got {len(row)}")
        records.append(CsvRecord(line, {k: v.strip() for k, v in zip(names, row, strict=True)}))
    return fmt, records


def parse_count(path: str, rec: CsvRecord, column: str) -> int:
    """A non-negative integer token/batch count ("16" and "16.0" both accepted)."""
    raw = rec.values[column]
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or not v.is_integer():
        raise ValueError(f"{path}:{rec.line}: {column}={raw!r} must be a non-negative integer")
    return int(v)


def parse_time(path: str, rec: CsvRecord, column: str) -> float:
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


def select_config(path: str, found: Sequence[str], config: str | None) -> str:
    """Validate the ``--config`` choice against the configs present in a grid file."""
    known = sorted(set(found))
    if config is None:
        if len(known) == 1:
            return known[0]
        raise ValueError(f"{path}: file holds several configs, choose one of: {', '.join(known)}")
    if config not in known:
        raise ValueError(f"{path}: unknown config {config!r}; known: {', '.join(known)}")
    return config


def list_configs(text: str, source: str) -> list[str]:
    """Configs present in a calibration grid, in first-seen order."""
    _, records = parse_csv_records(text.splitlines(keepends=True), source, (("config",),))
    return list(dict.fromkeys(r.values["config"] for r in records))


@dataclass(frozen=True, eq=False)  # numpy arrays inside: identity equality
class TimingColumns:
    """Two count columns and a time column of either format, in seconds."""

    first: NDArray[np.int64]
    second: NDArray[np.int64]
    seconds: NDArray[np.float64]
    config: str | None
    includes_overhead: bool


def parse_timing_csv(
    text: str,
    source: str,
    config: str | None,
    grid: tuple[Sequence[str], tuple[str, str, str]],
    observed: tuple[str, str, str],
) -> TimingColumns:
    """The one parser behind prefill and decode samples. ``grid`` = (its header, the two count
    columns and the milliseconds column it reads); ``observed`` = the header (counts, seconds).
    A grid file is filtered to ``config`` (required when it holds several)."""
    fmt, recs = parse_csv_records(text.splitlines(keepends=True), source, (grid[0], observed))
    if fmt == 0:
        chosen = select_config(source, [r.values["config"] for r in recs], config)
        recs = [r for r in recs if r.values["config"] == chosen]
        cols, scale, overhead = grid[1], 1e-3, False
    else:
        if config is not None:
            raise ValueError(
                f"{source}: config filter {config!r} given but file has no config column"
            )
        chosen, cols, scale, overhead = None, observed, 1.0, True
    if not recs:
        raise ValueError(f"{source}: no samples")
    return TimingColumns(
        np.array([parse_count(source, r, cols[0]) for r in recs], dtype=np.int64),
        np.array([parse_count(source, r, cols[1]) for r in recs], dtype=np.int64),
        np.array([parse_time(source, r, cols[2]) * scale for r in recs], dtype=np.float64),
        chosen,
        overhead,
    )


def parse_prefill_samples(text: str, source: str, config: str | None = None) -> PrefillSamples:
    cols = parse_timing_csv(
        text,
        source,
        config,
        (GRID_PREFILL_COLUMNS, ("n_new", "n_cached", "gpu_ms")),
        OBSERVED_PREFILL_COLUMNS,
    )
    return PrefillSamples(
        cols.first, cols.second, cols.seconds, source, cols.config, cols.includes_overhead
    )
