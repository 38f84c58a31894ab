"""parse_metrics on captured-style vLLM V1 / SGLang pages and on the edge cases around them."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.prometheus import EngineLoad, MetricsParseError, hit_rate_between, parse_metrics

DATA = Path(__file__).parent / "data"


def _fixture(name: str) -> str:
    return (DATA / name).read_text()


def test_vllm_v1_two_dp_engines_sum_counts_and_average_usage() -> None:
    load = parse_metrics(_fixture("vllm_v1_dp2_metrics.txt"), "p0", 12.5)
    assert load == EngineLoad(
        instance_id="p0",
        scraped_at_s=12.5,
        num_running=7 + 5,
        num_waiting=2 + 0,
        kv_usage=pytest.approx((0.4375 + 0.3125) / 2),
        prefix_cache_hits=123456 + 98304,
        prefix_cache_queries=200000 + 150000,
        block_size=16,
        num_gpu_blocks=2 * 27264,
        engine="vllm",
    )
    assert load.capacity_tokens == 16 * 2 * 27264


def test_vllm_deprecated_names_are_the_fallback() -> None:
    load = parse_metrics(_fixture("vllm_v1_deprecated_metrics.txt"), "p1", 0.0)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (3, 1, 0.0625)
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (1024, 4096)
    assert (load.block_size, load.num_gpu_blocks, load.engine) == (16, 8192, "vllm")


def test_sglang_dp_attention_ranks() -> None:
    load = parse_metrics(_fixture("sglang_dp2_metrics.txt"), "d0", 3.0)
    assert load.engine == "sglang"
    assert (load.num_running, load.num_waiting) == (24 + 20, 3 + 1)
    assert load.kv_usage == pytest.approx((0.61 + 0.55) / 2)
    assert load.cache_hit_rate == pytest.approx((0.42 + 0.38) / 2)
    assert (load.block_size, load.num_gpu_blocks) == (16, 2 * 9054)
    assert load.prefix_cache_hits is None and load.prefix_cache_queries is None


def test_new_name_wins_over_deprecated_without_double_counting() -> None:
    text = (
        'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n'
        'vllm:prefix_cache_hits_total{engine="0"} 10\n'
        'vllm:gpu_prefix_cache_hits_total{engine="0"} 10\n'
    )
    load = parse_metrics(text, "x", 0.0)
    assert (load.kv_usage, load.prefix_cache_hits) == (0.5, 10)


def test_tp_rank_copies_of_one_scheduler_are_not_summed() -> None:
    text = (
        'sglang:num_running_reqs{tp_rank="0"} 8\n'
        'sglang:num_running_reqs{tp_rank="1"} 8\n'
        'sglang:num_queue_reqs{tp_rank="0"} 2\n'
    )
    load = parse_metrics(text, "x", 0.0)
    assert (load.num_running, load.num_waiting) == (8, 2)


def test_missing_metrics_are_none_not_errors() -> None:
    load = parse_metrics('vllm:num_requests_running{engine="0"} 4\n', "x", 1.0)
    assert load.num_running == 4
    assert load.num_waiting is None and load.kv_usage is None and load.block_size is None
    assert load.capacity_tokens is None


def test_empty_and_foreign_pages_are_unknown_engine() -> None:
    for text in ("", "# HELP up x\n# TYPE up gauge\nup 1\n"):
        load = parse_metrics(text, "x", 2.0)
        assert load == EngineLoad(instance_id="x", scraped_at_s=2.0, engine="unknown")


def test_nan_and_unset_config_labels_read_as_unknown() -> None:
    text = (
        "vllm:kv_cache_usage_perc NaN\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    )
    load = parse_metrics(text, "x", 0.0)
    assert load.kv_usage is None and load.num_gpu_blocks is None and load.block_size == 16


def test_usage_is_clamped_to_a_fraction() -> None:
    assert parse_metrics("sglang:token_usage 1.07\n", "x", 0.0).kv_usage == 1.0


@pytest.mark.parametrize(
    "text",
    [
        'vllm:num_requests_running{engine="0" 1\n',
        "vllm:num_requests_running one\n",
        "this is not prometheus\n",
        "{} 1\n",
    ],
)
def test_malformed_text_raises_a_clear_error(text: str) -> None:
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_metrics(text, "x", 0.0)


def _counters(hits: int, queries: int) -> EngineLoad:
    return EngineLoad("x", 0.0, prefix_cache_hits=hits, prefix_cache_queries=queries)


def test_hit_rate_between_scrapes() -> None:
    assert hit_rate_between(_counters(100, 400), _counters(250, 600)) == pytest.approx(0.75)
    assert hit_rate_between(_counters(100, 400), _counters(100, 400)) is None  # no traffic
    assert hit_rate_between(_counters(100, 400), _counters(5, 10)) is None  # restarted
    assert hit_rate_between(EngineLoad("x", 0.0), _counters(1, 2)) is None
    sglang = parse_metrics(_fixture("sglang_dp2_metrics.txt"), "d", 0.0)
    assert hit_rate_between(sglang, sglang) == pytest.approx(0.40)


# --- pages captured from real engines (vLLM 0.32 CPU, llama-server 0.3.36) -------------------


def test_captured_vllm_0_32_page() -> None:
    # Three requests (2580, 2580, 2609 prompt tokens); the repeat hit 2560 tokens (80 blocks).
    load = parse_metrics(_fixture("vllm_0_32_metrics.txt"), "v", 1.0)
    assert load.engine == "vllm" and load.understood
    assert (load.num_running, load.num_waiting, load.num_waiting_for_capacity) == (0, 0, 0)
    assert load.kv_usage == 0.0
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (2560, 2580 + 2580 + 2609)
    assert (load.block_size, load.num_gpu_blocks) == (32, 16384)
    assert load.capacity_tokens == 32 * 16384 == load.token_capacity  # kv_cache_size_tokens


def test_captured_llamacpp_page_is_understood() -> None:
    # One request running; llamacpp:prompt_tokens_total (827) excludes the 822 cached tokens.
    load = parse_metrics(_fixture("llamacpp_metrics_busy.txt"), "l", 2.0)
    assert load.engine == "llamacpp" and load.understood
    assert (load.num_running, load.num_waiting) == (1, 0)
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (822, 827 + 822)
    assert load.kv_usage is None and load.capacity_tokens is None  # /slots has it


def test_explicit_flavour_that_does_not_match_is_not_understood() -> None:
    text = _fixture("llamacpp_metrics_busy.txt")
    assert parse_metrics(text, "l", 0.0, "llamacpp").num_running == 1
    wrong = parse_metrics(text, "l", 0.0, "vllm")
    assert wrong.engine == "vllm" and not wrong.understood and wrong.num_running is None
    assert not parse_metrics("# HELP up x\n# TYPE up gauge\nup 1\n", "u", 0.0).understood


def test_vllm_waiting_by_reason_is_the_fallback_for_waiting() -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 3\n'
        'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 2\n'
        'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 1\n'
    )
    load = parse_metrics(text, "x", 0.0)
    assert (load.num_waiting, load.num_waiting_for_capacity) == (6, 4)


def test_vllm_cached_prompt_counters_are_the_fallback_pair() -> None:
    text = "vllm:prompt_tokens_cached_total 40\nvllm:prompt_tokens_total 100\n"
    load = parse_metrics(text, "x", 0.0)
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (40, 100)


def test_sglang_current_names_sum_cache_sources_and_state_capacity() -> None:
    text = (
        'sglang:cached_tokens_total{model_name="m",cache_source="device"} 300\n'
        'sglang:cached_tokens_total{model_name="m",cache_source="host"} 100\n'
        'sglang:prompt_tokens_total{model_name="m"} 1000\n'
        'sglang:max_total_num_tokens{model_name="m"} 161721\n'
        'sglang:num_running_reqs{model_name="m"} 2\n'
    )
    load = parse_metrics(text, "s", 0.0)
    assert (load.prefix_cache_hits, load.prefix_cache_queries) == (400, 1000)
    assert load.capacity_tokens == 161721 and load.num_running == 2
    assert hit_rate_between(_counters(0, 0), load) == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("name", "flavour"),
    [
        ("vllm_0_32_metrics.txt", "vllm"),
        ("vllm_v1_dp2_metrics.txt", "vllm"),
        ("vllm_v1_deprecated_metrics.txt", "vllm"),
        ("sglang_dp2_metrics.txt", "sglang"),
        ("llamacpp_metrics_busy.txt", "llamacpp"),
    ],
)
def test_scanning_for_the_read_series_gives_what_parsing_the_whole_page_gives(
    name: str, flavour: str
) -> None:
    # Only the lines of the series a router reads are parsed (the rest of vLLM's ~600 lines
    # cost 6.5 ms of the event loop per scrape); the load must be the same as from all of them.
    from backends import prometheus

    text = _fixture(name)
    whole = prometheus._FLAVOURS[flavour](prometheus._collect(text), EngineLoad("x", 0.0))
    assert parse_metrics(text, "x", 0.0) == whole
    assert parse_metrics(text, "x", 0.0).understood
    kept, engine = prometheus._wanted_lines(text)
    assert engine == flavour and len(kept.splitlines()) < len(text.splitlines()) / 2


# Read off a real vLLM 0.32 (CPU) with --enable-lora --max-loras 1 and adapters a, b, after one
# request each: every adapter state seen stays on the page, the value says when it was set.
VLLM_LORA_PAGE = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="a",waiting_lora_adapters="a"} 1.7960047533290951e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} 1.7960047534152286e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="b",waiting_lora_adapters="b"} 1.7960047533969316e+09
"""  # noqa: E501


def test_vllm_lora_slots_come_from_the_newest_info_series() -> None:
    load = parse_metrics(VLLM_LORA_PAGE, "v", 0.0, "vllm")
    assert load.max_loras == 1 and load.running_adapters == frozenset()  # the newest: idle
    busy = VLLM_LORA_PAGE.replace('running_lora_adapters="b",', 'running_lora_adapters="b,a",')
    busy = busy.replace("1.7960047533969316e+09", "1.8e+09")
    assert parse_metrics(busy, "v", 0.0, "vllm").running_adapters == {"a", "b"}
    assert parse_metrics("vllm:num_requests_running 0\n", "v", 0.0, "vllm").max_loras is None
