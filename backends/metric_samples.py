"""Samples of one ``/metrics`` page folded per engine instance over data-parallel ranks.

- counts (running, waiting, prefix-cache token counters, cache blocks) are *summed* over data
  parallel ranks, because every DP rank is a separate scheduler with its own batch and cache;
- utilisations (KV usage, SGLang's hit rate) are *averaged* over ranks, because a fraction of
  one pool is not additive.

Within one rank a series can still appear several times (SGLang labels ``tp_rank``; a
multiprocess vLLM front end can repeat a gauge per API server). Those copies describe the
same scheduler, so they are collapsed with ``max`` rather than summed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Labels that name a data-parallel rank: vLLM V1 exports ``engine`` (the DP engine index),
# SGLang exports ``dp_rank`` when DP attention is on.
RANK_LABELS: tuple[str, ...] = ("engine", "dp_rank")


@dataclass(frozen=True, slots=True)
class Sample:
    value: float
    labels: Mapping[str, str]


def rank_of(labels: Mapping[str, str]) -> str:
    for name in RANK_LABELS:
        if name in labels:
            return labels[name]
    return ""


def per_rank(samples: Iterable[Sample], part_label: str | None = None) -> dict[str, float]:
    """Value per DP rank: copies of one series collapse with max; series that are distinct
    parts of one total (``part_label``, e.g. SGLang's cache_source) are added up."""
    parts: dict[tuple[str, str], float] = {}
    for s in samples:
        key = (rank_of(s.labels), s.labels.get(part_label, "") if part_label else "")
        parts[key] = max(parts.get(key, s.value), s.value)
    out: dict[str, float] = {}
    for (rank, _), value in parts.items():
        out[rank] = out.get(rank, 0.0) + value
    return out


def pick(by_name: Mapping[str, list[Sample]], names: tuple[str, ...]) -> list[Sample]:
    for name in names:
        if by_name.get(name):
            return by_name[name]
    return []


def total(
    by_name: Mapping[str, list[Sample]], names: tuple[str, ...], part_label: str | None = None
) -> int | None:
    ranks = per_rank(pick(by_name, names), part_label)
    return round(sum(ranks.values())) if ranks else None


def mean(by_name: Mapping[str, list[Sample]], names: tuple[str, ...]) -> float | None:
    ranks = per_rank(pick(by_name, names))
    if not ranks:
        return None
    # Clamped: SGLang's token_usage can briefly read above 1 while a batch over-commits, and
    # downstream code treats this as a fraction of capacity.
    return min(1.0, max(0.0, sum(ranks.values()) / len(ranks)))


def int_label(labels: Mapping[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None:
        return None
    try:
        value = int(float(raw))  # "16" and "16.0" both occur; "None" means unset
    except ValueError:
        return None
    return value if value > 0 else None


def label_total(samples: list[Sample], label: str) -> int | None:
    """Sum over DP ranks of an integer label of an info gauge (one sample per rank)."""
    by_rank: dict[str, int] = {}
    for s in samples:
        value = int_label(s.labels, label)
        if value is not None:
            by_rank[rank_of(s.labels)] = value
    return sum(by_rank.values()) if by_rank else None


def first_label(samples: list[Sample], label: str) -> int | None:
    for s in samples:
        value = int_label(s.labels, label)
        if value is not None:
            return value
    return None
