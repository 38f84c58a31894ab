"""Engine load from a Prometheus ``/metrics`` page: vLLM ``vllm:*``, SGLang ``sglang:*`` and
llama.cpp ``llamacpp:*`` (llama-server ``--metrics``).

This module only needs a few series a router reads (reference/peer-routers.md section 7.2;
the llama.cpp and vLLM 0.32 names were read off real servers, see tests/backends/data/). A
cheap line scan keeps the samples of those series, and ``prometheus_client``'s own parser
parses them: vLLM's page is ~600 lines, mostly histogram buckets, and parsing all of it took
6.5 ms of the gateway's event loop per scrape (measured on this 2-core box), which showed up
in the TTFT of the requests it delayed (docs/calibration.md section 4). A page with none of
those series is parsed whole, so malformed text is still an error. The series are folded per
instance over data-parallel ranks (``backends/metric_samples.py``).

The flavour is given (``engine`` of the instance) or detected from the names seen. A series
that is absent yields ``None`` ("unknown"), never an error: engines drop and rename metrics
between versions, and the gateway treats unknown load like stale load. ``EngineLoad.understood``
says whether anything usable was found at all, so the caller can say so instead of silently
routing on nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prometheus_client.parser import text_string_to_metric_families

from backends.metric_samples import (
    Sample,
    first_label,
    int_label,
    label_total,
    mean,
    per_rank,
    total,
)
from config.errors import KvgateError

Engine = Literal["vllm", "sglang", "llamacpp", "unknown"]
# What the caller knows about the engine: its flavour, or "auto" to detect it from the names.
EngineHint = Literal["auto", "vllm", "sglang", "llamacpp"]

_PREFIXES: tuple[tuple[str, Engine], ...] = (
    ("vllm:", "vllm"),
    ("sglang:", "sglang"),
    ("llamacpp:", "llamacpp"),
)

# Preference-ordered sample names per field: the first name present wins, so an engine that
# exports both the new and the deprecated name is not double counted.
_VLLM_RUNNING = ("vllm:num_requests_running",)
_VLLM_WAITING = ("vllm:num_requests_waiting",)
_VLLM_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
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
# Fallback pair when the prefix-cache counters are missing (they count connector hits too).
_VLLM_CACHED_PROMPT = ("vllm:prompt_tokens_cached_total",)
_VLLM_PROMPT = ("vllm:prompt_tokens_total",)
_VLLM_CONFIG = "vllm:cache_config_info"
# With --enable-lora: one series per adapter state seen, the value when it was (the newest is now).
_VLLM_LORA = "vllm:lora_requests_info"
_SGLANG_RUNNING = ("sglang:num_running_reqs",)
_SGLANG_WAITING = ("sglang:num_queue_reqs",)
_SGLANG_USAGE = ("sglang:token_usage",)
_SGLANG_HIT_RATE = ("sglang:cache_hit_rate",)
_SGLANG_CACHED = "sglang:cached_tokens_total"  # one series per cache_source (device/host/...)
_SGLANG_PROMPT = ("sglang:prompt_tokens_total",)  # all prompt tokens, cached ones included
_SGLANG_MAX_TOKENS = ("sglang:max_total_num_tokens",)
_SGLANG_CONFIG = "sglang:cache_config_info"
# llama-server: no KV usage gauge and no DP ranks; prompt_tokens_total *excludes* cached tokens.
_LLAMA_RUNNING = ("llamacpp:requests_processing",)
_LLAMA_WAITING = ("llamacpp:requests_deferred",)
_LLAMA_CACHED = ("llamacpp:prompt_tokens_cached_total",)
_LLAMA_COMPUTED = ("llamacpp:prompt_tokens_total",)


# Every sample name the flavours read; lines of other series are not parsed at all.
_WANTED: frozenset[str] = frozenset(
    {
        *_VLLM_RUNNING,
        *_VLLM_WAITING,
        _VLLM_WAITING_BY_REASON,
        *_VLLM_USAGE,
        *_VLLM_HITS,
        *_VLLM_QUERIES,
        *_VLLM_CACHED_PROMPT,
        *_VLLM_PROMPT,
        _VLLM_CONFIG,
        _VLLM_LORA,
        *_SGLANG_RUNNING,
        *_SGLANG_WAITING,
        *_SGLANG_USAGE,
        *_SGLANG_HIT_RATE,
        _SGLANG_CACHED,
        *_SGLANG_PROMPT,
        *_SGLANG_MAX_TOKENS,
        _SGLANG_CONFIG,
        *_LLAMA_RUNNING,
        *_LLAMA_WAITING,
        *_LLAMA_CACHED,
        *_LLAMA_COMPUTED,
    }
)


class MetricsParseError(KvgateError, ValueError):
    """The ``/metrics`` body is not valid Prometheus text exposition format."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one instance. ``None`` means the engine did not export that signal."""

    instance_id: str
    scraped_at_s: float  # caller's clock, when the page was read
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # 0..1, mean over DP ranks
    # Cumulative prompt-token counters: cached (hits) and all (queries). A hit rate needs two
    # scrapes, see ``hit_rate_between``.
    prefix_cache_hits: int | None = None
    prefix_cache_queries: int | None = None
    block_size: int | None = None  # tokens per KV block (SGLang: page size)
    num_gpu_blocks: int | None = None  # summed over DP ranks
    engine: Engine = "unknown"
    # SGLang exports a ready-made hit-rate gauge instead of counters.
    cache_hit_rate: float | None = None
    # vLLM: requests waiting because the KV cache is full (waiting_by_reason="capacity").
    num_waiting_for_capacity: int | None = None
    # KV capacity in tokens where the engine states it without a block count (SGLang
    # max_total_num_tokens, llama.cpp slots x context, vLLM kv_cache_size_tokens).
    token_capacity: int | None = None
    slots: int | None = None  # llama.cpp parallel slots (-np)
    # vLLM with LoRA: adapters it runs at once (--max-loras), and those running now.
    max_loras: int | None = None
    running_adapters: frozenset[str] | None = None

    @property
    def capacity_tokens(self) -> int | None:
        """KV capacity in tokens, when the engine reports its cache configuration."""
        if self.block_size is not None and self.num_gpu_blocks is not None:
            return self.block_size * self.num_gpu_blocks
        return self.token_capacity

    @property
    def understood(self) -> bool:
        """Whether the page gave any load signal at all (running, waiting or KV usage)."""
        return (
            self.num_running is not None
            or self.num_waiting is not None
            or (self.kv_usage is not None)
        )


def _wanted_lines(text: str) -> tuple[str, Engine]:
    """The sample lines of the series this module reads, and the engine whose metric prefix
    comes first on the page (comments and every other series skipped unparsed)."""
    keep: list[str] = []
    engine: Engine = "unknown"
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        head = line.split("{", 1)[0].split(None, 1)
        name = head[0] if head else ""
        if engine == "unknown":
            engine = detect_engine((name,))
        if name in _WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n", engine


def _collect(text: str) -> dict[str, list[Sample]]:
    by_name: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # NaN is how an engine says "no value yet" (e.g. before the first step).
                if math.isnan(sample.value):
                    continue
                by_name.setdefault(sample.name, []).append(Sample(sample.value, sample.labels))
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise MetricsParseError(f"not Prometheus text exposition format: {exc!s}") from exc
    return by_name


def detect_engine(names: Iterable[str]) -> Engine:
    """The engine whose metric prefix appears first among ``names``."""
    for name in names:
        for prefix, engine in _PREFIXES:
            if name.startswith(prefix):
                return engine
    return "unknown"


def _vllm(by_name: Mapping[str, list[Sample]], base: EngineLoad) -> EngineLoad:
    config = by_name.get(_VLLM_CONFIG, [])
    by_reason = by_name.get(_VLLM_WAITING_BY_REASON, [])
    waiting = total(by_name, _VLLM_WAITING)
    if waiting is None and by_reason:
        waiting = round(sum(per_rank(by_reason, "reason").values()))
    capacity_waits = [s for s in by_reason if s.labels.get("reason") == "capacity"]
    hits, queries = total(by_name, _VLLM_HITS), total(by_name, _VLLM_QUERIES)
    if hits is None and queries is None:
        hits, queries = total(by_name, _VLLM_CACHED_PROMPT), total(by_name, _VLLM_PROMPT)
    return _replace(
        base,
        engine="vllm",
        num_running=total(by_name, _VLLM_RUNNING),
        num_waiting=waiting,
        num_waiting_for_capacity=round(sum(per_rank(capacity_waits).values()))
        if capacity_waits
        else None,
        kv_usage=mean(by_name, _VLLM_USAGE),
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        block_size=first_label(config, "block_size"),
        num_gpu_blocks=label_total(config, "num_gpu_blocks"),
        token_capacity=label_total(config, "kv_cache_size_tokens"),
        **_lora(by_name.get(_VLLM_LORA, [])),
    )


def _lora(samples: list[Sample]) -> dict[str, object]:
    """``max_loras`` and ``running_adapters`` from the newest ``lora_requests_info`` series
    (its value is when vLLM last set it: older label sets linger on the page)."""
    if not samples:
        return {}
    newest = max(samples, key=lambda s: s.value)
    max_loras = int_label(newest.labels, "max_lora")
    if max_loras is None:  # LoRA off (max_lora 0)
        return {}
    running = newest.labels.get("running_lora_adapters", "")
    return {
        "max_loras": max_loras,
        "running_adapters": frozenset(a for a in running.split(",") if a),
    }


def _sglang(by_name: Mapping[str, list[Sample]], base: EngineLoad) -> EngineLoad:
    config = by_name.get(_SGLANG_CONFIG, [])
    hits = total(by_name, (_SGLANG_CACHED,), "cache_source")  # newer SGLang only
    return _replace(
        base,
        engine="sglang",
        num_running=total(by_name, _SGLANG_RUNNING),
        num_waiting=total(by_name, _SGLANG_WAITING),
        kv_usage=mean(by_name, _SGLANG_USAGE),
        prefix_cache_hits=hits,
        prefix_cache_queries=None if hits is None else total(by_name, _SGLANG_PROMPT),
        block_size=first_label(config, "page_size"),
        num_gpu_blocks=label_total(config, "num_pages"),
        token_capacity=total(by_name, _SGLANG_MAX_TOKENS),
        cache_hit_rate=mean(by_name, _SGLANG_HIT_RATE),
    )


def _llamacpp(by_name: Mapping[str, list[Sample]], base: EngineLoad) -> EngineLoad:
    cached, computed = total(by_name, _LLAMA_CACHED), total(by_name, _LLAMA_COMPUTED)
    return _replace(
        base,
        engine="llamacpp",
        num_running=total(by_name, _LLAMA_RUNNING),
        num_waiting=total(by_name, _LLAMA_WAITING),
        prefix_cache_hits=cached,
        # llama-server counts computed and cached prompt tokens apart; queries are both.
        prefix_cache_queries=None if cached is None or computed is None else cached + computed,
    )


def _replace(base: EngineLoad, **fields: object) -> EngineLoad:
    return EngineLoad(base.instance_id, base.scraped_at_s, **fields)  # type: ignore[arg-type]


_FLAVOURS = {"vllm": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}


def parse_metrics(
    text: str, instance_id: str, now_s: float, engine: EngineHint = "auto"
) -> EngineLoad:
    """Parse one ``/metrics`` page. Raises ``MetricsParseError`` on malformed text.

    ``engine`` picks the flavour; ``"auto"`` detects it from the metric names. A page that
    holds none of the flavour's names yields an ``EngineLoad`` that is not ``understood``.
    """
    wanted, seen = _wanted_lines(text)
    if wanted.strip():
        by_name = _collect(wanted)
    else:  # none of our series: parse it all, so that garbage is still an error
        by_name = _collect(text)
        seen = detect_engine(by_name)
    flavour = seen if engine == "auto" else engine
    base = EngineLoad(instance_id=instance_id, scraped_at_s=now_s)
    parse = _FLAVOURS.get(flavour)
    return base if parse is None else parse(by_name, base)


def hit_rate_between(earlier: EngineLoad, later: EngineLoad) -> float | None:
    """Prefix-cache token hit rate over the interval between two scrapes of one instance.

    ``None`` when either scrape lacks the counters, no query happened in between, or the
    counters went backwards (the engine restarted, so the difference means nothing).
    """
    if later.cache_hit_rate is not None and later.prefix_cache_queries is None:
        return later.cache_hit_rate  # SGLang without counters: the engine computed it
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
