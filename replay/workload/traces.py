"""Request traces: load Mooncake JSONL and CSV (Azure LLM inference, generic), select, summarise.

A trace is a list of ``TraceRequest`` in arrival order. Loaders validate every record and
raise ``TraceError`` naming the file and the 1-based line of the first bad record, because a
silently skipped or mangled request would skew every number the simulator reports.

Checked against the two published Mooncake traces (conversation, synthetic): every record
has ``len(hash_ids) == ceil(input_length / 512)`` and timestamps never decrease, so the
Mooncake loader enforces both strictly instead of tolerating drift.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from config.errors import KvgateError

BLOCK_SIZE = 512  # tokens per hash id in the Mooncake traces
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # 0-based position in the trace file (kept through select())
    arrival_s: float  # seconds from the start of the trace
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one id per 512-token prompt block; () when unknown (CSV)


class TraceError(KvgateError, ValueError):
    """A trace that cannot be used. ``line`` is 1-based; None when the file as a whole is bad."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        self.path = str(path)
        self.line = line
        self.message = message
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


def blocks_for(input_length: int, block_size: int = BLOCK_SIZE) -> int:
    """Number of hash ids a prompt of ``input_length`` tokens has (last block may be partial)."""
    return -(-input_length // block_size)


# ---------------------------------------------------------------------------------- Mooncake


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a count


def _positive_int(rec: dict[str, Any], key: str) -> int:
    value = rec[key]
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return int(value)


def _parse_mooncake(rec: Any, prev_ms: float | None) -> tuple[float, int, int, tuple[int, ...]]:
    """Validate one decoded record; raise ValueError with the message for TraceError."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    for key in MOONCAKE_KEYS:
        if key not in rec:
            raise ValueError(f"missing key {key!r}")
    ts = rec["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a non-negative number of milliseconds, got {ts!r}")
    if prev_ms is not None and ts < prev_ms:
        raise ValueError(f"timestamp {ts!r} ms is earlier than the previous record's {prev_ms:g}")
    input_length = _positive_int(rec, "input_length")
    output_length = _positive_int(rec, "output_length")
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"hash_ids must be a list of non-negative integers, got {ids!r}")
    for pos, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise ValueError(f"hash_ids[{pos}] must be a non-negative integer, got {h!r}")
    need = blocks_for(input_length)
    if len(ids) != need:
        raise ValueError(
            f"hash_ids has {len(ids)} ids but input_length {input_length} needs "
            f"ceil({input_length}/{BLOCK_SIZE}) = {need}"
        )
    return float(ts), input_length, output_length, tuple(ids)


def _numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) pairs. Lines are decoded one by one (not in the file
    object's chunks) so a decoding error names the exact line."""
    try:
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                try:
                    yield lineno, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise TraceError(path, lineno, f"not UTF-8 text ({exc.reason})") from None
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(path, None, f"cannot read: {exc.strerror or exc}") from None


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Load a Mooncake JSONL trace (``timestamp`` ms, lengths, chained ``hash_ids``).

    Blank lines are skipped; unknown extra keys are ignored so newer trace releases load.
    """
    p = Path(path)
    out: list[TraceRequest] = []
    prev_ms: float | None = None
    for lineno, text in _numbered_lines(p):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as exc:
            hint = " (expected JSON Lines: one object per line)" if text.lstrip()[:1] == "[" else ""
            msg = f"invalid JSON: {exc.msg} at column {exc.colno}{hint}"
            raise TraceError(path, lineno, msg) from None
        try:
            ts, n_in, n_out, ids = _parse_mooncake(rec, prev_ms)
        except ValueError as exc:
            raise TraceError(path, lineno, str(exc)) from None
        prev_ms = ts
        out.append(TraceRequest(len(out), ts / 1000.0, n_in, n_out, ids))
    return out


# --------------------------------------------------------------------------------------- CSV

# Column names are matched case-insensitively (Azure's TIMESTAMP is "timestamp"), first
# listed name wins.
_TIME_COLUMNS = ("arrival_s", "timestamp_s", "timestamp_ms", "arrival_ms", "timestamp", "time")
_INPUT_COLUMNS = ("input_length", "input_tokens", "prompt_tokens", "contexttokens")
_OUTPUT_COLUMNS = ("output_length", "output_tokens", "completion_tokens", "generatedtokens")
# Azure writes 7 fractional digits (100 ns ticks), more than datetime.fromisoformat takes in
# some Python versions, so the fraction is parsed by hand into integer nanoseconds. Times
# are naive (no zone): only differences between rows matter.
_DATETIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_datetime_ns(text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffffff]`` (naive, read as UTC) -> integer ns since the epoch."""
    m = _DATETIME.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a datetime: {text!r}")
    *fields, frac = m.groups()
    delta = datetime(*map(int, fields), tzinfo=UTC) - _EPOCH  # ValueError on 2023-13-40
    whole_s = delta.days * 86_400 + delta.seconds
    return whole_s * 1_000_000_000 + int((frac or "").ljust(9, "0"))


def _find_column(header: Sequence[str], wanted: Iterable[str]) -> int | None:
    lowered = [h.strip().lower() for h in header]
    for name in wanted:
        if name.lower() in lowered:
            return lowered.index(name.lower())
    return None


def _resolve(
    path: str | Path, header: Sequence[str], explicit: str | None, wanted: Iterable[str], what: str
) -> int:
    col = _find_column(header, [explicit] if explicit else wanted)
    if col is None:
        names = f"{explicit!r}" if explicit else " / ".join(wanted)
        raise TraceError(path, 1, f"no {what} column {names} in header {list(header)}")
    return col


def _csv_count(value: str, name: str, minimum: int) -> int:
    text = value.strip()
    if re.fullmatch(r"[+-]?[0-9]+", text) is None or int(text) < minimum:
        kind = "a positive" if minimum > 0 else "a non-negative"
        raise ValueError(f"{name} must be {kind} integer, got {value!r}")
    return int(text)


def _seconds_to_ns(cell: str, unit: float) -> int:
    t = float(cell) * unit
    if not math.isfinite(t):
        raise ValueError(f"not finite: {cell!r}")
    return round(t * 1e9)


def load_csv(
    path: str | Path,
    *,
    timestamp_col: str | None = None,
    input_col: str | None = None,
    output_col: str | None = None,
) -> list[TraceRequest]:
    """Load a CSV trace with a header row (Azure LLM inference traces or generic columns).

    Timestamps may be numbers (seconds; milliseconds when the column name ends in ``_ms``)
    or datetimes such as Azure's ``2023-11-16 18:15:46.6805900``. Arrivals are re-based so
    the earliest request is at 0 (CSV exports often carry wall-clock or epoch times), and rows
    are sorted stably by time: unlike the Mooncake files, third-party CSVs come with no
    ordering guarantee. ``index`` stays the 0-based data-row position. Output lengths of 0
    are accepted because some CSV traces record requests that generated nothing.
    """
    p = Path(path)
    lines = (text for _, text in _numbered_lines(p))
    reader = csv.reader(lines)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(path, None, "empty file: expected a header row") from None
    t_col = _resolve(path, header, timestamp_col, _TIME_COLUMNS, "timestamp")
    i_col = _resolve(path, header, input_col, _INPUT_COLUMNS, "input length")
    o_col = _resolve(path, header, output_col, _OUTPUT_COLUMNS, "output length")
    t_name, i_name, o_name = (header[c].strip() for c in (t_col, i_col, o_col))
    unit = 1e-3 if t_name.lower().endswith("_ms") else 1.0

    raw: list[tuple[int, int, int]] = []  # (time in ns, input, output)
    datetimes: bool | None = None  # decided by the first row so a file cannot mix the two
    for row in reader:
        lineno = reader.line_num
        if not row or all(not f.strip() for f in row):
            continue
        if len(row) != len(header):
            raise TraceError(path, lineno, f"expected {len(header)} fields, got {len(row)}")
        cell = row[t_col].strip()
        if datetimes is None:
            datetimes = _DATETIME.fullmatch(cell) is not None
        try:
            t_ns = parse_datetime_ns(cell) if datetimes else _seconds_to_ns(cell, unit)
        except ValueError:
            raise TraceError(
                path,
                lineno,
                f"{t_name} must be a number of seconds or a datetime like "
                f"2023-11-16 18:15:46.6805900, got {row[t_col]!r}",
            ) from None
        try:
            n_in = _csv_count(row[i_col], i_name, 1)
            n_out = _csv_count(row[o_col], o_name, 0)
        except ValueError as exc:
            raise TraceError(path, lineno, str(exc)) from None
        raw.append((t_ns, n_in, n_out))
    if not raw:
        return []
    t0 = min(r[0] for r in raw)
    reqs = [TraceRequest(i, (r[0] - t0) / 1e9, r[1], r[2], ()) for i, r in enumerate(raw)]
    return sorted(reqs, key=lambda r: r.arrival_s)  # sorted() is stable


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Load a trace by suffix: ``.jsonl``/``.json`` Mooncake, ``.csv`` CSV."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return load_mooncake(path)
    if suffix == ".csv":
        return load_csv(path)
    if not p.exists():
        raise TraceError(path, None, "no such file")
    raise TraceError(
        path,
        None,
        f"unknown trace format {suffix or '(no suffix)'!r}: expected .jsonl, .json or .csv",
    )


# ------------------------------------------------------------------------ selection, summary


def select(
    requests: Sequence[TraceRequest],
    *,
    speed: float = 1.0,
    start_s: float | None = None,
    duration_s: float | None = None,
    sample: float = 1.0,
    limit: int | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """Window [start, start+duration) on original times, sample, speed up, re-base, limit.

    Sampling draws one number per input request (in trace order) before windowing, so a
    request's fate depends only on (seed, position): a narrower window keeps exactly the
    subset of what a wider one keeps. Arrivals become ``(t - first_kept) / speed``.
    """
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be > 0, got {speed}")
    if not 0 < sample <= 1:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if not requests:
        return []
    lo = requests[0].arrival_s if start_s is None else start_s
    hi = math.inf if duration_s is None else lo + duration_s
    rng = random.Random(seed)
    draws = [rng.random() for _ in requests] if sample < 1 else None
    kept = [
        r
        for k, r in enumerate(requests)
        if lo <= r.arrival_s < hi and (draws is None or draws[k] < sample)
    ]
    if not kept:
        return []
    base = kept[0].arrival_s
    out = [replace(r, arrival_s=(r.arrival_s - base) / speed) for r in kept]
    return out if limit is None else out[:limit]


def blocks_seen_before(requests: Iterable[TraceRequest]) -> tuple[int, int]:
    """(blocks whose id appeared in an earlier request, all blocks): infinite-cache reuse.

    With chained ids a seen block implies its whole prefix was seen, so this equals the
    leading-prefix hit count of an infinite cache (``replay.sim.cache_analysis``).
    """
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        total += len(r.hash_ids)
        hits += sum(1 for h in r.hash_ids if h in seen)
        seen.update(r.hash_ids)
    return hits, total


def trace_summary(requests: Sequence[TraceRequest]) -> dict[str, int | float | None]:
    """Counts, span, rate, mean lengths and block reuse (None where undefined)."""
    n = len(requests)
    if n == 0:
        return {
            "requests": 0,
            "span_s": 0.0,
            "rate_rps": None,
            "mean_input_tokens": None,
            "mean_output_tokens": None,
            "blocks": 0,
            "unique_blocks": 0,
            "blocks_seen_before": None,
        }
    span = requests[-1].arrival_s - requests[0].arrival_s
    hits, total = blocks_seen_before(requests)
    return {
        "requests": n,
        "span_s": span,
        "rate_rps": n / span if span > 0 else None,
        "mean_input_tokens": sum(r.input_length for r in requests) / n,
        "mean_output_tokens": sum(r.output_length for r in requests) / n,
        "blocks": total,
        "unique_blocks": len({h for r in requests for h in r.hash_ids}),
        "blocks_seen_before": hits / total if total else None,
    }
