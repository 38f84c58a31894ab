"""The goodput upper bound: hand-checked pieces, and never below what a simulated run achieves."""

from __future__ import annotations

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
from replay.report.report import summarize
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import Simulator
from replay.sim.upper_bound import (
    Job,
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
