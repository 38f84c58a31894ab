"""The real-engine overload benchmark's pure parts: arguments, prompts, the gateway config it
writes, the ratios it reports. (A run against real engines: tests/real/test_real_overload.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.emulated_fleet import FleetSpec
from bench.real_overload import (
    FIRST_TOKEN_ID,
    LLAMA_ARGS,
    RealEngineFleet,
    late_decisions,
    overload_ratios,
    parse_args,
    progress_line,
    token_ids,
)
from config.loader import load_settings
from config.settings import AdmissionMode, EngineKind
from replay.workload.traces import TraceRequest
from tests.real.engines import EngineProcess


def test_defaults_per_engine() -> None:
    args = parse_args([])
    assert args.engine == "llamacpp" and args.engine_args == LLAMA_ARGS
    assert args.mode_list == ["none", "early"] and args.reference == "none"
    assert parse_args(["--engine", "vllm"]).engine_args == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--modes", "none,sometimes"],
        ["--modes", ""],
        ["--modes", "early,predictive"],  # the reference (none) is not among them
        ["--seconds", "0"],
        ["--rate-1x", "-1"],
        ["--rounds", "0"],
        ["--vocab-size", "5"],
        ["--profile", "/nonexistent/profile.json"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_prompts_fold_into_the_vocabulary_and_keep_shared_prefixes() -> None:
    encode = token_ids(300)
    a = TraceRequest(0, 0.0, 1000, 4, (1, 2))
    b = TraceRequest(1, 0.1, 1000, 4, (1, 3))
    ia, ib = encode(a), encode(b)
    assert len(ia) == len(ib) == 1000
    assert all(FIRST_TOKEN_ID <= t < 300 for t in ia + ib)
    assert ia[:512] == ib[:512] and ia[512:] != ib[512:]  # hash id 1 is one 512-token block
    assert encode(a) == ia  # the same request, the same prompt


def _engine(kind: str, port: int) -> EngineProcess:
    return EngineProcess(kind, f"http://127.0.0.1:{port}", 1, "tiny", None, None, Path("/dev/null"))


def test_the_gateway_config_admits_as_asked_with_the_profile(tmp_path: Path) -> None:
    args = parse_args([])
    spec = FleetSpec(workdir=tmp_path, base_port=18999, admission="early", ttft_slo_s=0.8)
    fleet = RealEngineFleet(spec, args, tmp_path / "engine.json")
    fleet.real = [_engine("llamacpp", 18001), _engine("llamacpp", 18002)]
    path = tmp_path / "gateway.toml"
    path.write_text(fleet._config({"e0": fleet.real[0].url, "e1": fleet.real[1].url}))
    s = load_settings(path)
    assert s.admission.mode is AdmissionMode.EARLY
    assert s.slo.ttft_s == 0.8 and s.slo.tbt_s == spec.tbt_slo_s
    assert s.predictors.profile_file == str(tmp_path / "engine.json")
    assert s.server.port == 18999 and s.server.admin_token == fleet.token
    (pool,) = s.pools
    assert [i.url for i in pool.instances] == [e.url for e in fleet.real]
    assert {i.engine for i in pool.instances} == {EngineKind.LLAMACPP}


def test_without_a_profile_the_gateway_keeps_its_default(tmp_path: Path) -> None:
    spec = FleetSpec(workdir=tmp_path, base_port=18999, admission="none")
    fleet = RealEngineFleet(spec, parse_args(["--engine", "vllm"]), None)
    fleet.real = [_engine("vllm", 18001)]
    path = tmp_path / "gateway.toml"
    path.write_text(fleet._config({"e0": fleet.real[0].url}))
    s = load_settings(path)
    assert s.admission.mode is AdmissionMode.NONE and s.predictors.profile_file is None


def test_overload_ratios_within_each_round() -> None:
    def run(rnd: int, mode: str, goodput: float | None) -> dict:
        return {"round": rnd, "admission": mode, "phases": [{}, {"goodput_rps": goodput}]}

    runs = [run(0, "none", 2.0), run(0, "early", 6.0), run(1, "early", 5.0), run(1, "none", 1.0)]
    assert overload_ratios(runs, "none") == {"early": {"per_round": [3.0, 5.0], "median": 4.0}}
    assert overload_ratios([run(0, "none", 0.0), run(0, "early", 3.0)], "none") == {}


def test_late_decisions_say_what_was_predicted_for_the_late_ones() -> None:
    def rec(predicted: float, queue: float, observed: float | None) -> dict:
        return {
            "predicted_ttft_s": predicted,
            "predicted_queue_s": queue,
            "predicted_prefill_s": predicted - queue,
            "observed_ttft_s": observed,
        }

    recent = [rec(0.2, 0.15, 1.3), rec(0.3, 0.25, 1.1), rec(0.9, 0.8, 2.0), rec(0.1, 0, 0.4)]
    recent.append(rec(0.5, 0.4, None))  # still in flight
    late = late_decisions(recent, 1.0)
    assert late == {
        "n": 3,
        "predicted_ttft_s": 0.3,
        "predicted_queue_s": 0.25,
        "predicted_prefill_s": 0.05,
        "observed_ttft_s": 1.3,
    }
    assert late_decisions(recent[3:], 1.0) == {"n": 0}


def test_the_progress_line_rounds_what_it_prints() -> None:
    phase = {"rejected": 3, "admitted": 359}
    one = {**phase, "phase": "1x", "goodput_rps": 11.9666, "slo_attainment": 0.84401}
    one["admitted_slo_miss_ratio"] = 0.15598
    empty = {**phase, "phase": "3x", "goodput_rps": None, "slo_attainment": None}
    empty["admitted_slo_miss_ratio"] = None
    line = progress_line({"admission": "early", "phases": [one, empty]})
    assert line == (
        "early: 1x: goodput 11.97 r/s (attainment 84.4 %), rejected 3, admitted 359 of which"
        " late 15.6 %; 3x: goodput - r/s (attainment -), rejected 3, admitted 359 of which late -"
    )
