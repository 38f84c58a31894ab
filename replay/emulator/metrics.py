"""The emulator's Prometheus metrics under vLLM's names (and SGLang's with --protocol sglang).

Names and labels follow reference/peer-routers.md section 7.2 (``model_name``, ``engine`` = DP
engine index, always "0" here). Each server has its own CollectorRegistry, so several
emulators in one process (tests, ``kvgate demo``) never share series. Latencies are measured
wall seconds, like a real engine's; with ``time_scale`` < 1 they are scaled down with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets, with a few sub-10 ms ones first so time-scaled runs still resolve.
_TTFT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot of the engine's state, taken at scrape time."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    deferred: int = 0  # waiting requests whose LoRA adapter has no free slot
    # LoRA adapters with a request that has produced output: vLLM 0.32 puts these same names
    # in both labels of lora_requests_info (running and waiting).
    adapters_listed: tuple[str, ...] = ()


class EmulatorMetrics:
    def __init__(
        self,
        model_name: str,
        *,
        sglang: bool,
        block_size: int,
        num_gpu_blocks: int,
        max_loras: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        reg, names = self.registry, ["model_name", "engine"]
        self._labels = (model_name, "0")
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the batch", names, registry=reg
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", names, registry=reg)
        self.waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            [*names, "reason"],
            registry=reg,
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage, 0..1", names, registry=reg
        )
        self.hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens", names, registry=reg
        )
        self.queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens", names, registry=reg
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prefill tokens processed", names, registry=reg
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed", names, registry=reg
        )
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*names, "block_size", "num_gpu_blocks"],
            registry=reg,
        )
        info.labels(*self._labels, str(block_size), str(num_gpu_blocks)).set(1)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            names,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between tokens",
            names,
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._sglang: tuple[Gauge, Gauge, Gauge, Gauge] | None = None
        if sglang:
            sg = ["model_name"]
            self._sglang = (
                Gauge("sglang:num_running_reqs", "Running requests", sg, registry=reg),
                Gauge("sglang:num_queue_reqs", "Queued requests", sg, registry=reg),
                Gauge("sglang:token_usage", "KV token usage, 0..1", sg, registry=reg),
                Gauge("sglang:cache_hit_rate", "Prefix cache hit rate", sg, registry=reg),
            )
        self._hit_tokens = 0
        self._query_tokens = 0
        # vLLM with --enable-lora: one series per adapter set seen, valued by when it was
        # last seen (so a reader takes the newest; older series stay, as in vLLM).
        self._max_loras = max_loras
        self._lora: Gauge | None = None
        if max_loras is not None:
            self._lora = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=reg,
            )

    def prefilled(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.hits.labels(*self._labels).inc(cached_tokens)
        self.queries.labels(*self._labels).inc(prompt_tokens)
        self.prompt_tokens.labels(*self._labels).inc(prompt_tokens - cached_tokens)
        self._hit_tokens += cached_tokens
        self._query_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(*self._labels).observe(seconds)

    def tokens(self, n: int, gap_s: float | None) -> None:
        """``n`` tokens arrived ``gap_s`` after the previous ones (None: the first ones)."""
        self.generation_tokens.labels(*self._labels).inc(n)
        if gap_s is not None:
            hist = self.itl.labels(*self._labels)
            for _ in range(n):
                hist.observe(gap_s / n)

    def finished(self, reason: str) -> None:
        self.success.labels(*self._labels, reason).inc()

    def render(self, load: EngineLoad) -> bytes:
        self.running.labels(*self._labels).set(load.running)
        self.waiting.labels(*self._labels).set(load.waiting)
        self.waiting_by_reason.labels(*self._labels, "capacity").set(load.waiting - load.deferred)
        self.waiting_by_reason.labels(*self._labels, "deferred").set(load.deferred)
        self.kv_usage.labels(*self._labels).set(load.kv_usage)
        if self._lora is not None:
            listed = ",".join(load.adapters_listed)
            self._lora.labels(str(self._max_loras), listed, listed).set_to_current_time()
        if self._sglang is not None:
            running, queue, usage, hit_rate = self._sglang
            model = self._labels[0]
            running.labels(model).set(load.running)
            queue.labels(model).set(load.waiting)
            usage.labels(model).set(load.kv_usage)
            rate = self._hit_tokens / self._query_tokens if self._query_tokens else 0.0
            hit_rate.labels(model).set(rate)
        return generate_latest(self.registry)
