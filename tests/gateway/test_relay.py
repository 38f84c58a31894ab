"""The relay of an engine's answer: batched histogram observations, usage tokens. (The stream
relay itself runs on real sockets in test_proxy.py and test_openai_sdk.py.)"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway.learning import DecisionRecord
from gateway.relay import StreamMarks, cache_report, observe_gaps, relay_stream, usage_tokens
from gateway.responses_api import TOKEN_MARK as RESPONSES_TOKEN
from gateway.responses_api import response_id


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


class _Pieces:
    """An engine answer arriving as the given chunks, each at its own clock time."""

    def __init__(self, chunks: list[tuple[float, bytes]], clock: list[float]) -> None:
        self.chunks, self.clock = list(chunks), clock

    def piece_reader(self):
        async def next_piece() -> tuple[bytes, bool] | None:
            if not self.chunks:
                return None
            at, chunk = self.chunks.pop(0)
            self.clock[0] = at
            return chunk, not self.chunks

        return next_piece


class _Books:
    def __init__(self) -> None:
        self.first: list[float] = []
        self.counted = 0

    def first_token(self, rid: str, now: float) -> float:
        self.first.append(now)
        return now

    def tokens(self, rid: str, n: int, now: float) -> None:
        self.counted += n


def _relay(chunks: list[tuple[float, bytes]], marks: StreamMarks | None):
    registry = CollectorRegistry()
    metrics = type("M", (), {})()
    metrics.ttft = Histogram("ttft", "x", registry=registry)
    metrics.tbt = Histogram("tbt", "x", registry=registry)
    clock = [0.0]
    record = DecisionRecord("r", 0.0, "a", "a", "normal", "", 1, 0, 0.1, 0.01)
    books, sent = _Books(), []

    async def send(message: dict) -> None:
        sent.append(message)

    upstream = _Pieces(chunks, clock)
    tokens, tail = asyncio.run(
        relay_stream(upstream, record, send, books, metrics, lambda: clock[0], None, marks)  # type: ignore[arg-type]
    )
    return tokens, tail, books, record, sent


RESPONSES_STREAM = (DATA / "vllm_0_32_responses_stream.txt").read_bytes()


def test_a_responses_stream_has_its_first_token_at_its_first_delta() -> None:
    events = [e + b"\n\n" for e in RESPONSES_STREAM.split(b"\n\n") if e]
    deltas = sum(b"event: response.output_text.delta" in e for e in events)
    # response.created + in_progress; then the output item and content part opened for the
    # first token, in a chunk of their own; then one event a chunk, the first delta at 3.0
    opening, added, rest = events[:2], events[2:4], events[4:]
    chunks = [(1.0, b"".join(opening)), (2.0, b"".join(added))]
    chunks += [(3.0 + i, e) for i, e in enumerate(rest)]
    marks = StreamMarks(RESPONSES_TOKEN)
    tokens, tail, books, record, sent = _relay(chunks, marks)
    usage = json.loads(events[-1].split(b"data: ", 1)[1])["response"]["usage"]
    # the engine's own count: vLLM's detokenizer joined two of its 5 tokens into one delta
    assert tokens == usage["output_tokens"] == 5 and deltas == 4
    assert record.observed_tbt_s == (chunks[-1][0] - 3.0) / (5 - 1)
    assert books.first == [3.0]  # at the first delta: no token came before it
    assert record.observed_ttft_s == 3.0
    assert marks.opening.startswith(b"event: response.created")
    assert response_id(marks.opening) == response_id(RESPONSES_STREAM[:4096]) is not None
    assert cache_report(tail) == cache_report(RESPONSES_STREAM) != (None, None)
    assert b"".join(m.get("body", b"") for m in sent) == b"".join(c for _, c in chunks)


def test_a_completion_stream_still_counts_its_first_chunk_as_its_first_token() -> None:
    chunks = [(1.0, b'data: {"choices":[{"text":"a"}]}\n\n'), (2.0, b"data: [DONE]\n\n")]
    tokens, _, books, _, _ = _relay(chunks, None)
    assert tokens == 1 and books.first == [1.0]


def test_responses_usage_names() -> None:
    whole = (DATA / "vllm_0_32_responses.json").read_bytes()
    usage = json.loads(whole)["usage"]
    assert usage_tokens(whole) == usage["output_tokens"] > 0
    cached = usage["input_tokens_details"]["cached_tokens"]
    assert cache_report(whole) == (cached, usage["input_tokens"])
