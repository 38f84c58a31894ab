"""The relay of an engine's answer: batched histogram observations, usage tokens. (The stream
relay itself runs on real sockets in test_proxy.py and test_openai_sdk.py.)"""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.relay import observe_gaps, usage_tokens


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
