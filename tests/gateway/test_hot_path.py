"""Hot-path helpers of the proxy: batched histogram observations, request ids, usage tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.proxy import _usage_tokens, new_request_id, observe_all


def test_observe_all_matches_observing_one_by_one() -> None:
    values = [0.0005, 0.001, 0.0011, 0.004, 0.02, 0.02, 0.3, 7.0, 0.0]
    regs = [CollectorRegistry(), CollectorRegistry()]
    a, b = (Histogram("tbt", "x", buckets=(0.001, 0.005, 0.1, 1), registry=r) for r in regs)
    for v in values:
        a.observe(v)
    observe_all(b, values)

    def lines(reg: CollectorRegistry) -> list[bytes]:
        return [x for x in generate_latest(reg).splitlines() if b"_created" not in x]

    assert lines(regs[0]) == lines(regs[1])


def test_request_ids_are_unique_32_hex_digits() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_usage_tokens_without_parsing_the_answer() -> None:
    body = (
        b'{"choices":[{"text":"say \\"completion_tokens\\": 99"}],'
        b'"usage":{"prompt_tokens":5,"completion_tokens": 16,"total_tokens":21}}'
    )
    assert _usage_tokens(body) == 16
    assert _usage_tokens(b'{"usage":{"completion_tokens":null}}') == 0
    assert _usage_tokens(b"not json") == 0
