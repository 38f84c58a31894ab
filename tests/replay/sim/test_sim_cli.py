"""`kvgate sim` end to end through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from replay.report.report import REQUIRED_KEYS
from replay.workload.synthetic import chat_spec, generate, write_mooncake

REQUIRED = set(REQUIRED_KEYS)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    write_mooncake(generate(chat_spec(requests=150, rate_rps=20.0, seed=1)), path)
    return path


def test_compare_writes_json_with_the_required_keys(trace: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    rc = main(
        [
            "sim",
            str(trace),
            "--prefill",
            "2",
            "--decode",
            "2",
            "--profile",
            "llama3-8b-h100-tp1",
            "--quiet",
            "--compare",
            "kvcache_centric+predictive,least_load,sglang_cache_aware",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == [
        "kvcache_centric+predictive",
        "least_load+none",
        "sglang_cache_aware+none",
    ]
    for r in runs:
        assert set(r) >= REQUIRED
        assert r["requests"] == 150 and r["wall_s"] > 0
    table = capsys.readouterr().out
    assert "kvcache_centric+predictive" in table


def test_bare_policy_takes_its_native_admission(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "sim",
                str(trace),
                "--prefill",
                "1",
                "--decode",
                "1",
                "--quiet",
                "--profile",
                "llama3-8b-h100-tp1",
                "--compare",
                "cache_aware",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads(out.read_text())["runs"][0]["admission"] == "early"


def test_bad_trace_line_names_file_and_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1, "input_length": -3, "output_length": 5, "hash_ids": [1]}\n'
    )
    assert main(["sim", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "input_length" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--compare", "fastest"], "unknown policy"),
        (["--compare", "least_load+maybe"], "unknown admission"),
        (["--prefill", "0"], "prefill"),
        (["--speed", "0"], "speed"),
        (["--profile", "gpt-9"], "gpt-9"),
        (["--param", "macro_size"], "KEY=VALUE"),
        (["--compare", "least_load", "--param", "macro_size=4"], "not a parameter"),
        (["--compare", "rolling_activation", "--param", "macro_size=2.5"], "expected int"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(trace: Path, capsys, args, needle) -> None:
    assert main(["sim", str(trace), "--quiet", *args]) == 2
    assert needle in capsys.readouterr().err


def test_sim_cache_subcommand(trace: Path, capsys) -> None:
    assert (
        main(
            [
                "sim",
                "cache",
                str(trace),
                "--capacities",
                "10,inf",
                "--policies",
                "lru,lfu",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["requests"] == 150
    got = {(r["policy"], r["capacity_blocks"]): r["hit_ratio"] for r in data["results"]}
    assert set(got) == {("lru", 10), ("lru", None), ("lfu", 10), ("lfu", None)}
    assert got[("lru", 10)] <= got[("lru", None)]


def test_policy_params_and_link_bandwidth(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["sim", str(trace), "--colocated", "4", "--quiet", "--profile", "llama3-8b-h100-tp1"]
    args += ["--compare", "rolling_activation", "--param", "macro_size=2"]
    args += ["--param", "max_window_s=1", "--link-gbps", "10", "--json", str(out)]
    assert main(args) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["policy"] == "rolling_activation" and run["requests"] == 150


def _on_and_off(trace: Path, tmp_path: Path, flag: str, *args: str) -> dict[str, dict]:
    """One early-admission kvcache_centric run per setting of an on|off ``flag``."""
    runs = {}
    for switch in ("on", "off"):
        out = tmp_path / f"{switch}.json"
        cmd = ["sim", str(trace), "--quiet", "--profile", "llama3-8b-h100-tp1"]
        cmd += ["--policy", "kvcache_centric", "--admission", "early", *args, flag, switch]
        assert main([*cmd, "--json", str(out)]) == 0
        runs[switch] = json.loads(out.read_text())["runs"][0]
    return runs


def test_best_effort_switch(trace: Path, tmp_path: Path) -> None:
    """A TTFT SLO shorter than the longer prompts' prefill: served late with best effort on
    (counted apart in the report), rejected with it off."""
    runs = _on_and_off(
        trace, tmp_path, "--best-effort", "--prefill", "2", "--decode", "2", "--ttft-slo", "0.02"
    )
    on, off = runs["on"], runs["off"]
    assert on["best_effort_admitted"] > 0 and off["best_effort_admitted"] == 0
    assert on["rejected"] < off["rejected"]
    assert on["promised_slo_miss_ratio"] <= on["admitted_slo_miss_ratio"]


def test_decode_reservation_switch(trace: Path, tmp_path: Path) -> None:
    """One decode instance and a tight TBT SLO overload decode: with the reservation on, some
    long prompts the plain TBT check would admit are turned away (counted in the report;
    the decode queue off, which would admit them later)."""
    runs = _on_and_off(
        trace,
        tmp_path,
        "--decode-reservation",
        "--prefill",
        "2",
        "--decode",
        "1",
        "--tbt-slo",
        "0.01",
        "--decode-queue",
        "off",
    )
    assert runs["on"]["reserve_turned_away"] > 0 and runs["off"]["reserve_turned_away"] == 0
    assert runs["on"]["rejected"] > runs["off"]["rejected"]


def test_doomed_warmup_switch(trace: Path, tmp_path: Path) -> None:
    """The same short TTFT SLO with best effort off: the doomed prompts turned away are warmed
    on idle prefill instances with the switch on (counted in the report), never with it off."""
    args = ("--best-effort", "off", "--prefill", "2", "--decode", "2", "--ttft-slo", "0.02")
    runs = _on_and_off(trace, tmp_path, "--doomed-warmup", *args)
    assert runs["on"]["doomed_warmups"] > 0 and runs["off"]["doomed_warmups"] == 0
    assert runs["on"]["rejected"] > 0


def test_tbt_headroom_and_decode_rebind_switches(tmp_path: Path) -> None:
    """Long prompts onto two decode instances of LLaMA2-70B (2023), whose decode binds: the
    learned headroom falls below 1 and admits more; ``fixed`` keeps it; ``--decode-rebind off``
    moves nothing."""
    from replay.workload.traces import TraceRequest

    def request(i: int) -> TraceRequest:
        tokens = 6144 + 512 * (i % 7)
        blocks = tuple(range(i * 100, i * 100 + tokens // 512))  # no shared prefixes
        return TraceRequest(i, i * 0.5, tokens, 200 + 30 * (i % 5), blocks)

    reqs = [request(i) for i in range(800)]
    trace = tmp_path / "long.jsonl"
    write_mooncake(reqs, trace)
    runs = {}
    for headroom, rebind in (("learned", "on"), ("fixed", "on"), ("learned", "off")):
        out = tmp_path / f"{headroom}-{rebind}.json"
        cmd = ["sim", str(trace), "--quiet", "--profile", "llama2-70b-a100-tp8-2023"]
        cmd += ["--prefill", "8", "--decode", "2", "--admission", "predictive"]
        cmd += ["--tbt-headroom", headroom, "--decode-rebind", rebind, "--json", str(out)]
        assert main(cmd) == 0
        runs[headroom, rebind] = json.loads(out.read_text())["runs"][0]
    learned, fixed = runs["learned", "on"], runs["fixed", "on"]
    assert learned["tbt_headroom_share"] < 1.0 and fixed["tbt_headroom_share"] == 1.0
    assert learned["admitted"] > fixed["admitted"]
    assert runs["learned", "off"]["decode_rebinds"] == 0


def test_network_switch_times_the_same_transfers_two_ways(tmp_path: Path) -> None:
    """Two prefill instances send long and short prompts' KV into one decode instance: with
    ``fair`` the short ones share its inbound link with the long ones instead of queueing
    behind them, so their first tokens come sooner; both move the same bytes."""
    from replay.workload.traces import TraceRequest

    def request(i: int) -> TraceRequest:
        tokens = 65536 if i % 4 == 0 else 2048
        blocks = tuple(range(i * 200, i * 200 + tokens // 512))  # no shared prefixes
        return TraceRequest(i, i * 0.05, tokens, 8, blocks)

    trace = tmp_path / "mixed.jsonl"
    write_mooncake([request(i) for i in range(40)], trace)
    runs = {}
    for network in ("fair", "calendar"):
        out = tmp_path / f"{network}.json"
        cmd = ["sim", str(trace), "--quiet", "--prefill", "2", "--decode", "1"]
        cmd += ["--admission", "none", "--ttft-after-transfer", "--link-gbps", "25"]
        assert main([*cmd, "--network", network, "--json", str(out)]) == 0
        runs[network] = json.loads(out.read_text())["runs"][0]
    fair, calendar = runs["fair"], runs["calendar"]
    assert (fair["network"], calendar["network"]) == ("fair", "calendar")
    assert fair["kv_transfer_bytes"] == calendar["kv_transfer_bytes"] > 0
    assert fair["ttft_p50_s"] < calendar["ttft_p50_s"]


def test_decode_queue_switch(trace: Path, tmp_path: Path) -> None:
    """The same decode overload: with the queue on, requests turned away on the TBT check wait
    and finished decodes admit them (counted in the report); off, they are rejected."""
    args = ("--prefill", "2", "--decode", "1", "--tbt-slo", "0.01")
    runs = _on_and_off(trace, tmp_path, "--decode-queue", *args)
    on, off = runs["on"], runs["off"]
    assert on["decode_queue"]["admitted"] > 0 and off["decode_queue"]["parked"] == 0
    assert on["rejected"] < off["rejected"]


def test_prefill_stall_switch(tmp_path: Path) -> None:
    """Long prompts onto two colocated LLaMA2-70B (2023) engines: without the check their
    prefills stall the decodes beside them past the TBT SLO; with it the promise holds and
    the report carries the learned credit."""
    from replay.workload.traces import TraceRequest

    reqs = [
        TraceRequest(i, i * 0.4, 6144, 200, tuple(range(i * 100, i * 100 + 12))) for i in range(300)
    ]
    trace = tmp_path / "colocated.jsonl"
    write_mooncake(reqs, trace)
    runs = {}
    for switch in ("on", "off"):
        out = tmp_path / f"{switch}.json"
        cmd = ["sim", str(trace), "--quiet", "--profile", "llama2-70b-a100-tp8-2023"]
        cmd += ["--colocated", "2", "--admission", "predictive", "--prefill-stall", switch]
        assert main([*cmd, "--json", str(out)]) == 0
        runs[switch] = json.loads(out.read_text())["runs"][0]
    on, off = runs["on"], runs["off"]
    assert off["promised_slo_miss_ratio"] > 0.2
    assert on["promised_slo_miss_ratio"] < 0.05
    assert on["goodput_rps"] > off["goodput_rps"]
    tbt = "before_prefill:tbt_slo"
    assert on["rejections_by_reason"][tbt] > off["rejections_by_reason"].get(tbt, 0)
    assert 0.0 <= on["stall_credit"] <= 1.0
