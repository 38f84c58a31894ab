"""The goodput upper bound: hand-checked pieces, and never below what a simulated run achieves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import (
    AdmissionMode,
    AdmissionSettings,
    PredictorSettings,
    RoutingSettings,
    Settings,
    SLOSettings,
)
from predictors.profiles import get_profile
from replay.engine.timing import StepTiming
from replay.report.report import summarize
from replay.sim import upper_bound
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import Simulator
from replay.sim.upper_bound import (
    DecodeTerms,
    Job,
    decode_set_cost,
    decode_share_costs,
    decode_terms,
    fraction_of_bound,
    goodput_bound,
    infinite_cache_hits,
    resource_bound,
    window_count,
)
from replay.workload.synthetic import chat_spec, generate
from replay.workload.traces import TraceRequest

PROFILE = "llama3-8b-h100-tp1"


def test_a_window_serves_the_cheapest_jobs_that_fit() -> None:
    jobs = [Job(0.0, 1.0, c) for c in (0.5, 0.2, 0.4, 0.3)]
    # One machine, one 1-second window: 0.2 + 0.3 + 0.4 = 0.9 fit, 0.5 does not.
    assert window_count(jobs, machines=1, length_s=1.0, offset_s=0.0) == 3
    assert window_count(jobs, machines=2, length_s=1.0, offset_s=0.0) == 4


def test_a_job_crossing_a_window_edge_counts_as_served() -> None:
    jobs = [Job(0.0, 1.0, 5.0), Job(0.9, 1.5, 5.0)]  # neither fits a 1-machine second
    # Windows [0, 1) and [1, 2): the first is inside and cannot be served; the second crosses.
    assert window_count(jobs, machines=1, length_s=1.0, offset_s=0.0) == 1
    assert resource_bound(jobs, machines=1) == 0  # some cut holds each inside a window


def test_infinite_cache_hits_count_leading_blocks_seen_before() -> None:
    trace = [
        TraceRequest(0, 0.0, 1024, 1, (1, 2)),
        TraceRequest(1, 1.0, 1536, 1, (1, 2, 3)),
        TraceRequest(2, 2.0, 1024, 1, (4, 2)),  # block 2 seen, but not as a prefix
        TraceRequest(3, 3.0, 1024, 1, (1, 2)),  # fully seen: all but the last token
    ]
    assert infinite_cache_hits(trace) == [0, 1024, 0, 1023]


def test_requests_whose_prefill_alone_misses_the_ttft_slo_are_not_counted() -> None:
    profile = get_profile(PROFILE)
    trace = [TraceRequest(i, float(i), 32_000, 4, ()) for i in range(3)]
    tight = goodput_bound(
        trace, profile, prefill_instances=1, decode_instances=1, ttft_slo_s=0.01, tbt_slo_s=0.1
    )
    assert tight.feasible == 0 and tight.requests == 0
    loose = goodput_bound(
        trace, profile, prefill_instances=1, decode_instances=1, ttft_slo_s=30, tbt_slo_s=0.1
    )
    assert loose.feasible == 3 and loose.requests == 3


def _settings(policy: str, admission: AdmissionMode) -> Settings:
    return Settings(
        slo=SLOSettings(ttft_s=2.0, tbt_s=0.05),
        routing=RoutingSettings(policy=policy, block_size=512),
        admission=AdmissionSettings(mode=admission),
        predictors=PredictorSettings(profile=PROFILE),
    )


@pytest.mark.parametrize("rate", [20.0, 80.0, 400.0])
def test_the_bound_is_never_below_a_simulated_run(rate: float) -> None:
    trace = generate(chat_spec(requests=300, rate_rps=rate, seed=5))
    fleet = FleetSpec(prefill=1, decode=1, profile=PROFILE)
    bound = goodput_bound(
        trace,
        get_profile(PROFILE),
        prefill_instances=1,
        decode_instances=1,
        ttft_slo_s=2.0,
        tbt_slo_s=0.05,
    )
    best = 0.0
    for policy, admission in [
        ("kvcache_centric", AdmissionMode.EARLY),
        ("kvcache_centric", AdmissionMode.NONE),
        ("round_robin", AdmissionMode.NONE),
    ]:
        result = Simulator(_settings(policy, admission), fleet, trace).run()
        goodput = summarize(result)["goodput_rps"] or 0.0
        assert goodput <= bound.goodput_rps + 1e-9, (policy, admission, goodput, bound)
        best = max(best, goodput)
    frac = fraction_of_bound(best, bound)
    assert frac is not None and 0 < frac <= 1
    if rate == 400.0:  # overloaded: some resource binds below the number of requests
        assert bound.requests < bound.total


def test_decode_share_costs_are_exact_for_equal_contexts() -> None:
    # Equal w: the tangent at alpha = sqrt(w) is exact, K * m * w with K = F / (tau - F).
    fixed, tau, w = 0.04, 0.1, 0.006
    forms = decode_share_costs([10, 20], [w, w], fixed, tau)
    assert forms and all(len(f) == 2 for f in forms)
    k = fixed / (tau - fixed)
    assert forms[0] == pytest.approx([k * 10 * w, k * 20 * w])
    assert decode_share_costs([10], [w], 0.1, 0.1) == []  # tau <= F: no alpha form
    assert decode_share_costs([0, 0], [w, w], fixed, tau) == []


def test_decode_set_cost_keeps_the_contexts_of_the_set() -> None:
    # m = 1, w = 1 and m = 1, w = 4: F * (1 + 2)^2 / ((tau - F) * 2) = 0.04 * 9 / 0.12 = 3.
    terms = [DecodeTerms(1, 0.0, 1.0, 0.5), DecodeTerms(1, 0.0, 4.0, 0.25)]
    assert decode_set_cost(terms, 0.04, 0.1) == pytest.approx(0.75 + 3.0)
    assert decode_set_cost([], 0.04, 0.1) == 0.0
    assert decode_set_cost(terms, 0.1, 0.1) == float("inf")  # no step meets tau <= F
    assert decode_set_cost([DecodeTerms(0, 0.0, 1.0, 0.0)], 0.1, 0.1) == 0.0  # nothing decodes


def test_decode_terms_follow_the_step_model() -> None:
    timing = StepTiming.from_profile(get_profile(PROFILE))
    t = decode_terms(TraceRequest(0, 0.0, 1000, 11, ()), timing)
    # 10 steps after the first token, over contexts 1001..1010.
    assert (t.steps, t.context) == (10, 1000 * 10 + 55)
    assert t.floor_w == pytest.approx(timing.b_s + timing.k_s * 1000)
    assert t.variable == pytest.approx(10 * timing.b_s + timing.k_s * t.context)


LONG_CONTEXT_PROFILE = "llama2-70b-a100-tp8-2023"  # 44 ms fixed step, 0.34 us per context token


def _long_context_trace() -> list[TraceRequest]:
    # 20k-token prompts: each decoding request adds ~6.9 ms to every step, so at most 8 share
    # a step within a 100 ms TBT, while the context-free form lets 256 share its fixed cost.
    return [TraceRequest(i, i * 0.25, 20_000, 101, ()) for i in range(160)]


def _long_context_bound(trace: list[TraceRequest]):
    return goodput_bound(
        trace,
        get_profile(LONG_CONTEXT_PROFILE),
        prefill_instances=64,
        decode_instances=1,
        ttft_slo_s=30.0,
        tbt_slo_s=0.1,
    )


def test_the_context_aware_decode_form_is_tighter_where_contexts_dominate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = _long_context_trace()
    tight = _long_context_bound(trace)
    monkeypatch.setattr(upper_bound, "decode_share_costs", lambda *a: [])
    loose = _long_context_bound(trace)
    assert tight.binding == "decode" == loose.binding
    # 65 of 160 requests against 113 with the context-free form (a simulated kvcache_centric
    # run without admission meets the SLOs for 39).
    assert tight.requests < 0.7 * loose.requests


@pytest.mark.parametrize("admission", [AdmissionMode.NONE, AdmissionMode.EARLY])
def test_the_context_aware_bound_is_never_below_a_simulated_run(admission: AdmissionMode) -> None:
    trace = _long_context_trace()
    bound = _long_context_bound(trace)
    settings = Settings(
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
        routing=RoutingSettings(policy="kvcache_centric", block_size=512),
        admission=AdmissionSettings(mode=admission),
        predictors=PredictorSettings(profile=LONG_CONTEXT_PROFILE),
    )
    fleet = FleetSpec(prefill=64, decode=1, profile=LONG_CONTEXT_PROFILE)
    result = summarize(Simulator(settings, fleet, trace).run())
    assert 0 < (result["goodput_rps"] or 0.0) <= bound.goodput_rps


def test_prefill_alone_charges_each_prompt_its_own_step() -> None:
    # 500 short prompts a second on one unchunked prefill instance: the fixed step cost, not
    # the tokens, limits it, which only the prefill_alone form sees; a simulated run stays below.
    trace = [TraceRequest(i, i * 0.002, 64, 2, ()) for i in range(400)]
    kwargs = {"prefill_instances": 1, "decode_instances": 1, "ttft_slo_s": 0.5, "tbt_slo_s": 0.05}
    profile = get_profile(PROFILE)
    shared = goodput_bound(trace, profile, **kwargs)
    alone = goodput_bound(trace, profile, prefill_alone=True, **kwargs)
    assert shared.by_resource["prefill"] == 400
    assert alone.by_resource["prefill"] < 0.7 * 400 and alone.binding == "prefill"
    colocated = goodput_bound(trace, profile, colocated=1, prefill_alone=True, **kwargs)
    assert colocated.by_resource["prefill"] == 400  # mixed steps share the fixed cost
    fleet = FleetSpec(prefill=1, decode=1, profile=PROFILE)
    for admission in (AdmissionMode.NONE, AdmissionMode.EARLY):
        settings = _settings("kvcache_centric", admission)
        settings = replace(settings, slo=SLOSettings(ttft_s=0.5, tbt_s=0.05))
        run = summarize(Simulator(settings, fleet, trace).run())
        assert 0 < (run["goodput_rps"] or 0.0) <= alone.goodput_rps
