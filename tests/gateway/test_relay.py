"""The relay of an engine's answer: batched histogram observations, usage tokens. (The stream
relay itself runs on real sockets in test_proxy.py and test_openai_sdk.py.)"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.relay import cache_report, observe_gaps, usage_tokens


def test_observe_gaps_matches_observing_each_gap() -> None:
    stamps = [10.0, 10.0005, 10.0015, 10.0026, 10.0066, 10.0266, 10.0466, 10.3466, 17.3466]
    regs = [CollectorRegistry(), CollectorRegistry()]
    a, b = (Histogram("tbt", "x", buckets=(0.001, 0.005, 0.1, 1), registry=r) for r in regs)
    for x, y in itertools.pairwise(stamps):
        a.observe(y - x)
    observe_gaps(b, stamps)
    observe_gaps(b, stamps[:1])  # one stamp: no gap, nothing observed

    def samples(reg: CollectorRegistry) -> dict[str, float]:
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for m in reg.collect()
            for s in m.samples
            if not s.name.endswith("_created")
        }

    want, got = samples(regs[0]), samples(regs[1])
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_usage_tokens_without_parsing_the_answer() -> None:
    body = (
        b'{"choices":[{"text":"say \\"completion_tokens\\": 99"}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens": 16,"total_tokens":21}}'
    )
    assert usage_tokens(body) == 16
    assert usage_tokens(b'{"usage":{"completion_tokens":null}}') == 0
    assert usage_tokens(b"not json") == 0


DATA = Path(__file__).parents[1] / "backends" / "data"


@pytest.mark.parametrize(
    ("name", "want"),
    [
        # vLLM 0.32 --enable-prompt-tokens-details: whole 32-token blocks
        ("vllm_0_32_completion_cached.json", (2560, 2580)),
        ("vllm_0_32_chat_stream.txt", (0, 2609)),  # the final usage chunk
        ("llamacpp_completion_cached.json", (401, 402)),  # last token recomputed
        ("llamacpp_chat_stream_usage.txt", (0, 421)),
        ("llamacpp_chat_stream_timings.txt", (420, 421)),  # no usage: timings.cache_n
    ],
)
def test_cache_report_on_captured_answers(name: str, want: tuple[int, int]) -> None:
    body = (DATA / name).read_bytes()
    assert cache_report(body) == want
    assert cache_report(body[-700:]) == want  # what a stream relay keeps: its last chunks


def test_cache_report_absent_or_null() -> None:
    assert cache_report(b'{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}') == (
        None,
        None,
    )
    assert cache_report(b'{"choices":[{"text":"\\"cached_tokens\\": 7"}]}') == (None, None)
    assert cache_report(b'{"timings":{"cache_n":3}}') == (3, None)
