"""Trace loaders, selection and summary (``replay.workload.traces``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from replay.workload.traces import (
    TraceError,
    TraceRequest,
    load_csv,
    load_mooncake,
    load_trace,
    parse_datetime_ns,
    select,
    trace_summary,
)

# README figures of the two published Mooncake traces.
REAL_TRACES = {
    "conversation_trace.jsonl": {"requests": 12031, "seen": 0.366, "in": 12035, "out": 343},
    "synthetic_trace.jsonl": {"requests": 3993, "seen": 0.640, "in": 15325, "out": 149},
}


def traces_dir() -> Path | None:
    """``$KVGATE_TRACES``, else /work/shared/traces, else ``shared/traces`` beside the repo."""
    env = os.environ.get("KVGATE_TRACES")
    candidates = [Path(env)] if env else []
    candidates += [
        Path("/work/shared/traces"),
        Path(__file__).resolve().parents[3] / ".." / "shared" / "traces",
    ]
    return next((c for c in candidates if (c / "conversation_trace.jsonl").is_file()), None)


def real_trace(name: str) -> list[TraceRequest]:
    base = traces_dir()
    if base is None:
        pytest.skip("Mooncake traces not found (set KVGATE_TRACES to their directory)")
    return load_trace(base / name)


def rec(ts: object = 5, n_in: object = 1000, n_out: object = 10, ids: object = None) -> str:
    hash_ids = [0, 1] if ids is None else ids
    d = {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": hash_ids}
    return json.dumps(d)


GOOD = rec()


def write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


# ------------------------------------------------------------------------------ Mooncake


def test_error_message_names_file_and_line(tmp_path: Path) -> None:
    lines = [rec(ts=i) for i in range(16)] + [rec(ts=16, n_in=-3)]
    p = write(tmp_path, lines, "conversation_trace.jsonl")
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    assert info.value.line == 17
    assert info.value.path == str(p)
    assert str(info.value) == (f"{p}:17: input_length must be a positive integer, got -3")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"timestamp": 1, "input_length": 10', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got str"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing key 'hash_ids'"),
        (rec(n_in=-3), "input_length must be a positive integer, got -3"),
        (rec(n_in=0), "input_length must be a positive integer, got 0"),
        (rec(n_in=True, ids=[0]), "input_length must be a positive integer, got True"),
        (rec(n_in=1000.0), "input_length must be a positive integer, got 1000.0"),
        (rec(n_out=0), "output_length must be a positive integer, got 0"),
        (rec(n_out="5"), "output_length must be a positive integer, got '5'"),
        (rec(ts="soon"), "timestamp must be a non-negative number of milliseconds"),
        (rec(ts=-1), "timestamp must be a non-negative number of milliseconds"),
        (rec(ts=False), "timestamp must be a non-negative number of milliseconds"),
        (rec(ids="0,1"), "hash_ids must be a list of non-negative integers"),
        (rec(ids=[0, -1]), "hash_ids[1] must be a non-negative integer, got -1"),
        (rec(ids=[0, 1.5]), "hash_ids[1] must be a non-negative integer, got 1.5"),
        (rec(ids=[True, 1]), "hash_ids[0] must be a non-negative integer, got True"),
        (rec(ids=[0]), "hash_ids has 1 ids but input_length 1000 needs ceil(1000/512) = 2"),
        (rec(n_in=1024, ids=[0, 1, 2]), "needs ceil(1024/512) = 2"),
        (rec(ts=4), "timestamp 4 ms is earlier than the previous record's 5"),
    ],
)
def test_bad_line_is_reported_with_its_line_number(tmp_path: Path, bad: str, message: str) -> None:
    # Line 1 good at 0 ms, line 2 blank (skipped but counted), line 3 good at 5 ms, line 4 bad.
    p = write(tmp_path, [rec(ts=0), "", GOOD, bad, GOOD])
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    assert info.value.line == 4
    assert message in info.value.message
    assert str(info.value).startswith(f"{p}:4: ")


def test_json_array_gets_a_hint(tmp_path: Path) -> None:
    p = write(tmp_path, ["[", GOOD + ",", "]"], "t.json")
    with pytest.raises(TraceError, match=r":1: invalid JSON.*JSON Lines"):
        load_trace(p)


def test_non_utf8_line_is_reported(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_bytes((GOOD + "\n" + GOOD + "\n").encode() + b'{"x": "\xff"}\n')
    with pytest.raises(TraceError) as info:
        load_mooncake(p)
    assert info.value.line == 3
    assert "UTF-8" in info.value.message


def test_good_file_loads(tmp_path: Path) -> None:
    lines = [
        rec(ts=0, n_in=512, ids=[7]),
        "   ",
        json.dumps(
            {
                "timestamp": 1500.5,
                "input_length": 513,
                "output_length": 3,
                "hash_ids": [7, 9],
                "extra": "ignored",
            }
        ),
        rec(ts=1500.5, n_in=1, n_out=1, ids=[8]),
    ]
    reqs = load_mooncake(write(tmp_path, lines))
    assert reqs == [
        TraceRequest(0, 0.0, 512, 10, (7,)),
        TraceRequest(1, 1.5005, 513, 3, (7, 9)),
        TraceRequest(2, 1.5005, 1, 1, (8,)),
    ]


def test_load_trace_dispatch_and_file_errors(tmp_path: Path) -> None:
    assert len(load_trace(write(tmp_path, [GOOD], "a.JSONL"))) == 1
    (tmp_path / "b.txt").write_text(GOOD)
    with pytest.raises(TraceError, match=r"unknown trace format '\.txt'") as info:
        load_trace(tmp_path / "b.txt")
    assert info.value.line is None
    for missing in ("nope.jsonl", "nope.csv", "nope.txt"):
        with pytest.raises(TraceError, match="no such file"):
            load_trace(tmp_path / missing)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(TraceError, match="directory"):
        load_trace(tmp_path / "dir.jsonl")


# ------------------------------------------------------------------------------------ CSV


def test_azure_csv_with_seven_fractional_digits(tmp_path: Path) -> None:
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "\n"
        "2023-11-16 23:59:59.9999999,879,0\n"
        "2023-11-17 00:00:00.0000001,91,5\n"
    )
    reqs = load_trace(p)
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    # 18:15:46.68059 -> midnight is 20653.31941 s; the last two rows are 200 ns apart.
    assert reqs[2].arrival_s == pytest.approx(20653.3194099, abs=1e-9)
    assert reqs[3].arrival_s - reqs[2].arrival_s == pytest.approx(2e-7, abs=1e-9)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in reqs] == [
        (374, 44, ()),
        (396, 109, ()),
        (879, 0, ()),
        (91, 5, ()),
    ]


def test_parse_datetime_ns() -> None:
    assert parse_datetime_ns("1970-01-01 00:00:01.5") == 1_500_000_000
    assert parse_datetime_ns("1970-01-02T00:00:00") == 86_400 * 10**9
    with pytest.raises(ValueError):
        parse_datetime_ns("2023-13-01 00:00:00")


def test_generic_csv_columns_units_and_sorting(tmp_path: Path) -> None:
    p = tmp_path / "g.csv"
    p.write_text(
        "id,timestamp_ms,prompt_tokens,output_tokens\na,3000,10,1\nb,1000,20,2\nc,1000,30,3\n"
    )
    reqs = load_csv(p)
    # Sorted stably by time, re-based to the earliest row, original row index kept.
    assert [(r.index, r.arrival_s, r.input_length) for r in reqs] == [
        (1, 0.0, 20),
        (2, 0.0, 30),
        (0, 2.0, 10),
    ]
    q = tmp_path / "s.csv"
    q.write_text("arrival_s,input_tokens,output_length\n10.5,5,6\n12.0,7,8\n")
    assert [r.arrival_s for r in load_csv(q)] == [0.0, 1.5]
    r = tmp_path / "x.csv"
    r.write_text("t,a,b\n1,100,2\n3,200,4\n")
    got = load_csv(r, timestamp_col="t", input_col="a", output_col="b")
    assert [(x.arrival_s, x.input_length, x.output_length) for x in got] == [
        (0, 100, 2),
        (2, 200, 4),
    ]


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ("when,a,b\n1,2,3\n", 1, "no timestamp column"),
        ("timestamp,tokens,output_tokens\n1,2,3\n", 1, "no input length column"),
        (
            "timestamp,input_tokens,output_tokens\n1,2,3\n2,0,3\n",
            3,
            "input_tokens must be a positive",
        ),
        ("timestamp,input_tokens,output_tokens\n1,2,3\n2,5,-1\n", 3, "must be a non-negative"),
        ("timestamp,input_tokens,output_tokens\n1,2,3\n\n2,5,x\n", 4, "got 'x'"),
        ("timestamp,input_tokens,output_tokens\n1,2,3\n2,5\n", 3, "expected 3 fields, got 2"),
        ("timestamp,input_tokens,output_tokens\nnow,2,3\n", 2, "must be a number of seconds"),
        (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,1,1\n5,1,1\n",
            3,
            "TIMESTAMP must be a number of seconds or a datetime",
        ),
    ],
)
def test_bad_csv_rows(tmp_path: Path, body: str, line: int, message: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert info.value.line == line
    assert message in info.value.message


def test_explicit_missing_column_and_empty_csv(tmp_path: Path) -> None:
    p = tmp_path / "c.csv"
    p.write_text("timestamp,input_tokens,output_tokens\n")
    assert load_csv(p) == []
    with pytest.raises(TraceError, match="no input length column 'ctx'"):
        load_csv(p, input_col="ctx")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(TraceError, match="header"):
        load_csv(tmp_path / "e.csv")


# ------------------------------------------------------------------------------ select()


def make(times: list[float]) -> list[TraceRequest]:
    return [TraceRequest(i, t, 100, 10, (i,)) for i, t in enumerate(times)]


def test_select_window_speed_and_rebase() -> None:
    reqs = make([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    got = select(reqs, start_s=1.5, duration_s=3.0, speed=2.0)
    assert [(r.index, r.arrival_s) for r in got] == [(2, 0.0), (3, 0.5), (4, 1.0)]
    assert select(reqs, duration_s=2.0) == reqs[:2]  # [first, first + 2) excludes t=2
    assert [r.index for r in select(reqs, limit=2, start_s=4.0)] == [4, 5]
    assert select(reqs, start_s=10.0) == []
    assert select([], speed=3.0) == []
    assert select(reqs) == reqs


def test_select_sampling_is_deterministic_and_nested() -> None:
    reqs = make([i * 0.1 for i in range(5000)])
    a = select(reqs, sample=0.3, seed=7)
    assert a == select(reqs, sample=0.3, seed=7)
    assert [r.index for r in a] != [r.index for r in select(reqs, sample=0.3, seed=8)]
    assert 0.27 < len(a) / len(reqs) < 0.33
    # A request's fate depends only on (seed, position): a window keeps a subset.
    wide = {r.index for r in a}
    narrow = {r.index for r in select(reqs, sample=0.3, seed=7, start_s=100.0, duration_s=50.0)}
    assert narrow and narrow <= wide
    assert narrow == {i for i in wide if 100.0 <= reqs[i].arrival_s < 150.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speed": 0.0}, "speed must be > 0"),
        ({"speed": -1.0}, "speed must be > 0"),
        ({"sample": 0.0}, r"sample must be in \(0, 1\]"),
        ({"sample": 1.5}, r"sample must be in \(0, 1\]"),
        ({"duration_s": 0.0}, "duration_s must be > 0"),
        ({"limit": -1}, "limit must be >= 0"),
    ],
)
def test_select_validates(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        select(make([0.0]), **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- summaries


def test_summary_of_small_trace() -> None:
    reqs = [
        TraceRequest(0, 0.0, 1024, 10, (0, 1)),
        TraceRequest(1, 2.0, 1500, 20, (0, 1, 2)),
        TraceRequest(2, 4.0, 600, 30, (0, 3)),
    ]
    s = trace_summary(reqs)
    assert s["requests"] == 3 and s["span_s"] == 4.0 and s["rate_rps"] == 0.75
    assert s["mean_output_tokens"] == 20.0
    assert (s["blocks"], s["unique_blocks"]) == (7, 4)
    assert s["blocks_seen_before"] == pytest.approx(3 / 7)
    assert trace_summary([])["blocks_seen_before"] is None
    assert trace_summary(make([1.0]))["rate_rps"] is None


@pytest.mark.parametrize("name", sorted(REAL_TRACES))
def test_real_traces_match_readme(name: str) -> None:
    reqs = real_trace(name)
    want = REAL_TRACES[name]
    s = trace_summary(reqs)
    assert s["requests"] == want["requests"]
    assert s["blocks_seen_before"] == pytest.approx(want["seen"], abs=0.001)
    assert s["mean_input_tokens"] == pytest.approx(want["in"], abs=1)
    assert s["mean_output_tokens"] == pytest.approx(want["out"], abs=1)
    assert [r.index for r in reqs] == list(range(len(reqs)))
    assert reqs[0].arrival_s == 0.0
    half = select(reqs, speed=2.0)
    assert half[-1].arrival_s == pytest.approx(reqs[-1].arrival_s / 2)
