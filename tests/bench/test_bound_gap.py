"""bench/bound_gap.py: the packing references and rejection classes on hand-checked cases,
and the CLI end to end on a real simulated run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.bound_gap import (
    FEASIBLE,
    INFEASIBLE,
    PREFIX_EVICTED,
    PREFIX_NEVER_COMPUTED,
    classify_rejection,
    leading_hit,
    main,
    packed_count,
    tangent_costs,
)
from predictors.profiles import get_profile
from replay.engine.timing import StepTiming
from replay.sim.upper_bound import DecodeTerms, decode_set_cost
from replay.workload.synthetic import chat_spec, generate, write_mooncake

TERMS = [DecodeTerms(1, 0.0, w, v) for w, v in ((1.0, 3.0), (4.0, 4.0), (9.0, 5.0))]


def test_packing_takes_the_order_given_until_one_does_not_fit() -> None:
    # No fixed cost (F = 0): a set costs its variable parts, 3 + 4 = 7 <= 8 < 3 + 4 + 5.
    assert packed_count(TERMS, [0, 1, 2], 8.0, 0.0, 0.1) == 2
    assert packed_count(TERMS, [2, 1, 0], 8.0, 0.0, 0.1) == 1  # 5, then 5 + 4 > 8
    assert packed_count(TERMS, [0, 1, 2], 12.0, 0.0, 0.1) == 3
    assert packed_count(TERMS, [], 1.0, 0.0, 0.1) == 0


def test_packing_prices_a_set_with_its_fixed_step_share() -> None:
    capacity = decode_set_cost(TERMS[:2], 0.04, 0.1)  # exactly the first two
    assert packed_count(TERMS, [0, 1, 2], capacity, 0.04, 0.1) == 2
    assert packed_count(TERMS, [0, 1, 2], capacity * 0.999, 0.04, 0.1) == 1


def test_tangent_costs_sum_to_the_set_cost_at_their_own_alpha() -> None:
    # The tangent u^2/v >= 2 alpha u - alpha^2 v is exact at alpha = u / v.
    costs = tangent_costs(TERMS, 0.04, 0.1)
    assert sum(costs) == pytest.approx(decode_set_cost(TERMS, 0.04, 0.1))
    assert costs[0] < costs[1] < costs[2]  # longer contexts cost more
    assert tangent_costs(TERMS, 0.1, 0.1) == [3.0, 4.0, 5.0]  # tau <= F: variable parts only


def test_a_ttft_rejection_is_classed_by_what_the_caches_held() -> None:
    timing = StepTiming.from_profile(get_profile("llama2-70b-a100-tp8-2023"))
    slo = timing.prefill(20_000, 0) + 0.01  # a cold 20k-token prompt just fits

    def cls(prompt: int, infinite: int, computed: int, fleet: int) -> str:
        return classify_rejection(prompt, infinite, computed, fleet, timing, slo)

    assert cls(60_000, 0, 0, 0) == INFEASIBLE
    assert cls(60_000, 50_000, 50_000, 10_000) == PREFIX_EVICTED
    assert cls(60_000, 50_000, 10_000, 10_000) == PREFIX_NEVER_COMPUTED
    assert cls(60_000, 50_000, 50_000, 50_000) == FEASIBLE
    assert cls(20_000, 0, 0, 0) == FEASIBLE  # cold, yet turned away (queue, headroom)


def test_leading_hit_counts_only_the_leading_blocks() -> None:
    assert leading_hit((1, 2, 3), {1, 2}, 512, 2000) == 1024
    assert leading_hit((1, 2, 3), {2, 3}, 512, 2000) == 0
    assert leading_hit((1, 2), {1, 2}, 512, 1024) == 1023  # never the whole prompt


def _cli(tmp_path: Path, prefill: int, ttft_slo: float, tbt_slo: float) -> dict:
    """The CLI on 150 synthetic chat requests at 300 r/s, on ``prefill`` P + 1 D; its JSON."""
    trace = tmp_path / "chat.jsonl"
    write_mooncake(generate(chat_spec(requests=150, rate_rps=300.0, seed=2)), trace)
    out = tmp_path / "gap.json"
    args = [str(trace), "--prefill", str(prefill), "--decode", "1"]
    args += ["--profile", "llama3-8b-h100-tp1", "--ttft-slo", str(ttft_slo)]
    assert main([*args, "--tbt-slo", str(tbt_slo), "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_cli_splits_a_real_run_and_writes_json(tmp_path: Path, capsys) -> None:
    report = _cli(tmp_path, 2, 0.5, 0.02)  # overloaded: some requests are turned away
    assert report == json.loads(capsys.readouterr().out)
    assert 0 < report["goodput_rps"] <= report["bound_rps"]
    assert report["of_bound"] == pytest.approx(report["goodput_rps"] / report["bound_rps"], 1e-3)
    assert sum(report["rejections"].values()) == report["run"]["rejected"] > 0
    d = report["decode"]
    assert d["served"]["rps"] == report["goodput_rps"]
    assert d["clairvoyant_packing"]["rps"] >= d["prompt_ranked_packing"]["rps"]
    # Picking by true cost chooses cheaper requests than picking by prompt length.
    assert d["clairvoyant_packing"]["mean_cost_s"] <= d["prompt_ranked_packing"]["mean_cost_s"]
    for packing in ("clairvoyant_packing", "prompt_ranked_packing"):
        assert 0.9 < d[packing]["least_cost_share"] <= 1.0  # they fill the pool
    pf = report["prefill"]
    assert pf["busy_share"] >= pf["served_share"] >= pf["served_share_with_infinite_cache"] > 0


def test_cli_runs_a_decode_bound_point_where_requests_wait_for_decode_room(tmp_path: Path) -> None:
    """4P + 1D and a TBT SLO the one decode instance meets only with a short batch: requests
    wait in the decode queue, whose retries go through the recorded ``schedule`` too (that
    call once lacked the decode queue's ``parked`` flag and the run crashed)."""
    report = _cli(tmp_path, 4, 5.0, 0.012)
    assert report["rejections"].get("tbt_slo", 0) > 0  # decode binds here
    assert report["run"]["admitted"] + report["run"]["rejected"] == 150


def test_cli_names_a_missing_trace(tmp_path: Path, capsys) -> None:
    assert main([str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl" in capsys.readouterr().err
