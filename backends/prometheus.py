"""Engine load from a Prometheus ``/metrics`` page (vLLM V1 ``vllm:*`` or SGLang ``sglang:*``).

The text is parsed by ``prometheus_client``'s own parser; this module only picks the few
series a router needs (reference/peer-routers.md section 7.2) and folds the per-rank series
into one number per instance:

- counts (running, waiting, prefix-cache token counters, cache blocks) are *summed* over data
  parallel ranks, because every DP rank is a separate scheduler with its own batch and cache;
- utilisations (KV usage, SGLang's hit rate) are *averaged* over ranks, because a fraction of
  one pool is not additive.

Within one rank a series can still appear several times (SGLang labels ``tp_rank``; a
multiprocess vLLM front end can repeat a gauge per API server). Those copies describe the
same scheduler, so they are collapsed with ``max`` rather than summed.

A series that is absent yields ``None`` ("unknown"), never an error: engines drop and rename
metrics between versions, and the gateway treats unknown load like stale load.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

Engine = Literal["vllm", "sglang", "unknown"]

# Labels that name a data-parallel rank: vLLM V1 exports ``engine`` (the DP engine index),
# SGLang exports ``dp_rank`` when DP attention is on.
_RANK_LABELS: tuple[str, ...] = ("engine", "dp_rank")

# Preference-ordered sample names per field: the first name present wins, so an engine that
# exports both the new and the deprecated name is not double counted.
_VLLM_RUNNING = ("vllm:num_requests_running",)
_VLLM_WAITING = ("vllm:num_requests_waiting",)
_VLLM_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_VLLM_HITS = (
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_hits",
)
_VLLM_QUERIES = (
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:prefix_cache_queries",
    "vllm:gpu_prefix_cache_queries",
)
_VLLM_CONFIG = "vllm:cache_config_info"
_SGLANG_RUNNING = ("sglang:num_running_reqs",)
_SGLANG_WAITING = ("sglang:num_queue_reqs",)
_SGLANG_USAGE = ("sglang:token_usage",)
_SGLANG_HIT_RATE = ("sglang:cache_hit_rate",)
_SGLANG_CONFIG = "sglang:cache_config_info"


class MetricsParseError(ValueError):
    """The ``/metrics`` body is not valid Prometheus text exposition format."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one instance. ``None`` means the engine did not export that signal."""

    instance_id: str
    scraped_at_s: float  # caller's clock, when the page was read
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # 0..1, mean over DP ranks
    # Cumulative token counters (vLLM); a hit rate needs two scrapes, see ``hit_rate_between``.
    prefix_cache_hits: int | None = None
    prefix_cache_queries: int | None = None
    block_size: int | None = None  # tokens per KV block (SGLang: page size)
    num_gpu_blocks: int | None = None  # summed over DP ranks
    engine: Engine = "unknown"
    # SGLang exports a ready-made hit-rate gauge instead of counters.
    cache_hit_rate: float | None = None

    @property
    def capacity_tokens(self) -> int | None:
        """GPU KV capacity in tokens, when the engine reports its cache configuration."""
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


@dataclass(frozen=True, slots=True)
class _Sample:
    value: float
    labels: Mapping[str, str]


def _rank(labels: Mapping[str, str]) -> str:
    for name in _RANK_LABELS:
        if name in labels:
            return labels[name]
    return ""


def _per_rank(samples: Iterable[_Sample]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        key = _rank(s.labels)
        out[key] = max(out.get(key, s.value), s.value)
    return out


def _pick(by_name: Mapping[str, list[_Sample]], names: tuple[str, ...]) -> list[_Sample]:
    for name in names:
        if by_name.get(name):
            return by_name[name]
    return []


def _sum(by_name: Mapping[str, list[_Sample]], names: tuple[str, ...]) -> int | None:
    ranks = _per_rank(_pick(by_name, names))
    return round(sum(ranks.values())) if ranks else None


def _mean(by_name: Mapping[str, list[_Sample]], names: tuple[str, ...]) -> float | None:
    ranks = _per_rank(_pick(by_name, names))
    if not ranks:
        return None
    # Clamped: SGLang's token_usage can briefly read above 1 while a batch over-commits, and
    # downstream code treats this as a fraction of capacity.
    return min(1.0, max(0.0, sum(ranks.values()) / len(ranks)))


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None:
        return None
    try:
        value = int(float(raw))  # "16" and "16.0" both occur; "None" means unset
    except ValueError:
        return None
    return value if value > 0 else None


def _cache_config(
    samples: list[_Sample], size_label: str, count_label: str
) -> tuple[int | None, int | None]:
    """(block size, total blocks) from an info gauge; one sample per DP rank, if any."""
    block_size: int | None = None
    per_rank: dict[str, int] = {}
    for s in samples:
        block_size = block_size or _int_label(s.labels, size_label)
        count = _int_label(s.labels, count_label)
        if count is not None:
            per_rank[_rank(s.labels)] = count
    return block_size, (sum(per_rank.values()) if per_rank else None)


def _collect(text: str) -> dict[str, list[_Sample]]:
    by_name: dict[str, list[_Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # NaN is how an engine says "no value yet" (e.g. before the first step).
                if math.isnan(sample.value):
                    continue
                by_name.setdefault(sample.name, []).append(_Sample(sample.value, sample.labels))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise MetricsParseError(f"not Prometheus text exposition format: {exc!s}") from exc
    return by_name


def _detect(by_name: Mapping[str, list[_Sample]]) -> Engine:
    if any(name.startswith("vllm:") for name in by_name):
        return "vllm"
    if any(name.startswith("sglang:") for name in by_name):
        return "sglang"
    return "unknown"


def parse_metrics(text: str, instance_id: str, now_s: float) -> EngineLoad:
    """Parse one ``/metrics`` page. Raises ``MetricsParseError`` on malformed text."""
    by_name = _collect(text)
    engine = _detect(by_name)
    if engine == "vllm":
        block_size, blocks = _cache_config(
            by_name.get(_VLLM_CONFIG, []), "block_size", "num_gpu_blocks"
        )
        return EngineLoad(
            instance_id=instance_id,
            scraped_at_s=now_s,
            num_running=_sum(by_name, _VLLM_RUNNING),
            num_waiting=_sum(by_name, _VLLM_WAITING),
            kv_usage=_mean(by_name, _VLLM_USAGE),
            prefix_cache_hits=_sum(by_name, _VLLM_HITS),
            prefix_cache_queries=_sum(by_name, _VLLM_QUERIES),
            block_size=block_size,
            num_gpu_blocks=blocks,
            engine="vllm",
        )
    if engine == "sglang":
        block_size, blocks = _cache_config(
            by_name.get(_SGLANG_CONFIG, []), "page_size", "num_pages"
        )
        return EngineLoad(
            instance_id=instance_id,
            scraped_at_s=now_s,
            num_running=_sum(by_name, _SGLANG_RUNNING),
            num_waiting=_sum(by_name, _SGLANG_WAITING),
            kv_usage=_mean(by_name, _SGLANG_USAGE),
            block_size=block_size,
            num_gpu_blocks=blocks,
            engine="sglang",
            cache_hit_rate=_mean(by_name, _SGLANG_HIT_RATE),
        )
    return EngineLoad(instance_id=instance_id, scraped_at_s=now_s)


def hit_rate_between(earlier: EngineLoad, later: EngineLoad) -> float | None:
    """Prefix-cache token hit rate over the interval between two scrapes of one instance.

    ``None`` when either scrape lacks the counters, no query happened in between, or the
    counters went backwards (the engine restarted, so the difference means nothing).
    """
    if later.cache_hit_rate is not None and later.prefix_cache_queries is None:
        return later.cache_hit_rate  # SGLang: the engine already computed it
    values = (
        earlier.prefix_cache_hits,
        earlier.prefix_cache_queries,
        later.prefix_cache_hits,
        later.prefix_cache_queries,
    )
    if any(v is None for v in values):
        return None
    h0, q0, h1, q1 = (int(v) for v in values if v is not None)
    dq, dh = q1 - q0, h1 - h0
    if dq <= 0 or dh < 0:
        return None
    return min(1.0, dh / dq)
