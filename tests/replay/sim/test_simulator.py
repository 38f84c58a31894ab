"""The discrete-event simulator: hand-checked TTFTs, determinism, late rejection, clean books."""

from __future__ import annotations

import json
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
from replay.report.results import Outcome
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import SimOptions, Simulator
from replay.workload.synthetic import chat_spec, generate
from replay.workload.traces import TraceRequest

PROFILE = "llama3-8b-h100-tp1"


def settings(policy: str = "kvcache_centric", admission: AdmissionMode = AdmissionMode.NONE):
    return Settings(
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
        routing=RoutingSettings(policy=policy, block_size=512),
        admission=AdmissionSettings(mode=admission),
        predictors=PredictorSettings(profile=PROFILE),
    )


def tr(i: int, t: float, blocks: tuple[int, ...], out: int, tokens: int | None = None):
    return TraceRequest(i, t, tokens or len(blocks) * 512, out, blocks)


def test_tiny_trace_ttfts_match_hand_computation() -> None:
    trace = [
        tr(0, 0.0, (1, 2), 1),  # 1024 new tokens
        tr(1, 0.0, (1, 3), 1),  # waits for r0, then block 1 is cached: 512 new
        tr(2, 10.0, (1, 2), 1),  # everything cached: the engine computes only the last token
    ]
    sim = Simulator(settings(), FleetSpec(prefill=1, decode=1, profile=PROFILE), trace)
    result = sim.run()
    p = get_profile(PROFILE)
    a, b, t0, c = p.mixed.a_ms, p.mixed.b_ms, p.mixed.t0, p.mixed.c_ms
    o = 0.5  # PredictorSettings.overhead_ms

    def step_ms(n: int, cached: int) -> float:
        return o + a + b * max(n, t0) + c * n * (cached + n / 2)

    t_r0 = step_ms(1024, 0) / 1e3
    t_r1 = t_r0 + step_ms(512, 512) / 1e3
    t_r2 = step_ms(1, 1023) / 1e3
    ttfts = [r.ttft_s for r in result.requests]
    assert ttfts == pytest.approx([t_r0, t_r1, t_r2], rel=1e-9)
    assert [r.cached_tokens for r in result.requests] == [0, 512, 1023]
    assert all(r.outcome is Outcome.COMPLETED for r in result.requests)


def test_decode_time_follows_the_step_model() -> None:
    trace = [tr(0, 0.0, (1,), 11)]
    sim = Simulator(settings(), FleetSpec(prefill=1, decode=1, profile=PROFILE), trace)
    (r,) = sim.run().requests
    timing = StepTiming.from_profile(get_profile(PROFILE), 0.5)
    kv = 512 * get_profile(PROFILE).kv_bytes_per_token / (200e9 / 8) + 0.0005
    expected_finish = r.ttft_s + kv + timing.decode_steps(1, 512, 10)
    assert r.finish_s == pytest.approx(expected_finish, rel=1e-9)
    assert r.generated == 11
    # TBT counts decode steps only (the KV transfer overlaps the prefill in Mooncake).
    assert r.tbt_mean_s == pytest.approx(timing.decode_steps(1, 512, 10) / 10)


def test_wire_accounting_moves_the_join_wait_from_tbt_into_ttft() -> None:
    # r1's KV lands while the decode instance is mid-step on r0: it waits for the boundary.
    trace = [tr(0, 0.0, (1,), 1000), tr(1, 0.0, (2,), 2)]
    fleet = FleetSpec(prefill=1, decode=1, profile=PROFILE)
    mooncake = Simulator(settings(), fleet, trace).run().requests[1]
    wire = Simulator(settings(), fleet, trace, SimOptions(ttft_after_transfer=True)).run()
    r1 = wire.requests[1]
    timing = StepTiming.from_profile(get_profile(PROFILE), 0.5)
    kv = 512 * get_profile(PROFILE).kv_bytes_per_token / (200e9 / 8) + 0.0005
    assert r1.finish_s == pytest.approx(mooncake.finish_s)  # same schedule, other accounting
    join_wait = r1.ttft_s - (mooncake.ttft_s + kv)
    assert join_wait > 0
    assert mooncake.tbt_mean_s == pytest.approx(r1.tbt_mean_s + join_wait)
    # The wire's only gap is one decode step of the two-sequence batch.
    one_step = (timing.decode_steps(2, 1024, 1), timing.decode_steps(2, 2024, 1))
    assert one_step[0] <= r1.tbt_mean_s <= one_step[1]


def _chat(n: int = 400):
    return generate(chat_spec(requests=n, rate_rps=40.0, seed=3))


def test_same_inputs_give_identical_reports() -> None:
    fleet = FleetSpec(prefill=2, decode=2, profile=PROFILE)

    def once() -> str:
        res = Simulator(settings("random"), fleet, _chat()).run()
        s = summarize(res)
        s.pop("wall_s", None)
        s.pop("sim_speedup", None)
        s.pop("requests_per_wall_s", None)
        return json.dumps(s, sort_keys=True)

    assert once() == once()


def test_books_are_clean_after_the_run() -> None:
    sim = Simulator(settings(), FleetSpec(prefill=2, decode=2, profile=PROFILE), _chat())
    result = sim.run()
    assert all(r.outcome is Outcome.COMPLETED for r in result.requests)
    assert not sim.conductor.requests
    for inst in sim.conductor.instances.values():
        assert inst.idle and inst.reserved_tokens == 0 and inst.batch == 0
    for engine in sim.engines.values():
        assert engine.next_event_s() is None and engine.reserved_tokens == 0


def test_decode_local_check_rejects_after_prefill_and_early_rejection_prevents_it() -> None:
    # A tight TBT SLO that a loaded decode instance breaks: without admission the decode
    # instance refuses after the prefill was paid for; early rejection refuses before.
    trace = [tr(i, i * 0.01, (1000 + i,), 400, tokens=8000) for i in range(200)]
    tight = SLOSettings(ttft_s=30.0, tbt_s=0.012)
    fleet = FleetSpec(prefill=2, decode=1, profile=PROFILE)
    late = Simulator(replace(settings(), slo=tight), fleet, trace).run()
    n_late = sum(r.outcome is Outcome.REJECTED_AFTER_PREFILL for r in late.requests)
    assert n_late > 0
    early_settings = replace(settings(admission=AdmissionMode.EARLY), slo=tight)
    early = Simulator(early_settings, fleet, trace).run()
    n_early_late = sum(r.outcome is Outcome.REJECTED_AFTER_PREFILL for r in early.requests)
    assert n_early_late < n_late
    assert sum(r.outcome is Outcome.REJECTED for r in early.requests) > 0


def test_colocated_fleet_runs_prefill_and_decode_on_one_instance() -> None:
    fleet = FleetSpec(prefill=0, decode=0, colocated=2, profile=PROFILE)
    result = Simulator(settings("least_load"), fleet, _chat(100)).run()
    assert all(r.outcome is Outcome.COMPLETED for r in result.requests)
    assert all(r.prefill_instance == r.decode_instance for r in result.requests)
    assert result.kv_transfer_bytes == 0


def test_cache_aware_placement_hits_more_than_random() -> None:
    fleet = FleetSpec(prefill=4, decode=2, profile=PROFILE)
    hit = {}
    for policy in ("random", "cache_aware"):
        s = summarize(Simulator(settings(policy), fleet, _chat(600)).run())
        hit[policy] = s["cache_hit_ratio"]
    assert hit["cache_aware"] > hit["random"]


def test_conditional_disagg_prefills_short_prompts_on_the_decode_instance() -> None:
    # One prefill instance buried under 20 long prompts; short prompts arriving behind them are
    # prefilled on the decode instance (no KV transfer) when the switch is on.
    long = [tr(i, 0.0, tuple(range(1000 * i, 1000 * i + 16)), 2) for i in range(20)]
    short = [tr(20 + i, 0.01 * (i + 1), (9_000_000 + i,), 20, tokens=64) for i in range(5)]
    trace = long + short
    fleet = FleetSpec(prefill=1, decode=1, profile=PROFILE)
    base = settings()
    on = replace(base, routing=replace(base.routing, conditional_disagg=True))
    off_run = Simulator(base, fleet, trace).run()
    on_run = Simulator(on, fleet, trace).run()
    assert "local_prefills" not in off_run.extra
    assert on_run.extra["local_prefills"] == 5
    by_id = {r.request_id: r for r in on_run.requests}
    for i in range(20, 25):
        r, r_off = by_id[f"r{i}"], off_run.requests[i]
        assert r.outcome is Outcome.COMPLETED and r.generated == 20
        assert r.prefill_instance == r.decode_instance == "d0"
        assert r.ttft_s < r_off.ttft_s / 10  # no wait behind the long prompts
    assert all(r.outcome is Outcome.COMPLETED for r in on_run.requests)


def test_a_request_counting_on_another_requests_pull_is_prefilled_after_it_lands() -> None:
    p, rest = tuple(range(1, 61)), tuple(range(200, 261))  # 60 blocks of 512 tokens each
    trace = [
        tr(0, 0.0, (*p, 1000), 2),  # p0 computes the prefix
        tr(1, 5.0, p + rest, 2),  # extends it on p0, which is busy for ~1.7 s
        tr(2, 5.1, (*p, 1002), 2),  # pulls the prefix from busy p0 to idle p1
        tr(3, 5.12, (*p, 1003), 2),  # predicted to reuse r2's copy at p1
    ]
    sim = Simulator(settings(), FleetSpec(prefill=2, decode=1, profile=PROFILE), trace)
    decisions = {}
    schedule = sim.conductor.schedule

    def record(req, now, *args, **kwargs):
        decisions[req.request_id] = d = schedule(req, now, *args, **kwargs)
        return d

    sim.conductor.schedule = record  # type: ignore[method-assign]
    out = {o.request_id: o for o in sim.run().requests}
    assert decisions["r2"].pull_source == "p0" and decisions["r2"].prefill == "p1"
    assert decisions["r3"].prefill == "p1" and len(decisions["r3"].waits_for) == 1
    # Sent at once, r3 would have been prefilled before the copy landed: recomputing the
    # 30k-token prefix (~1 s) and holding r2 behind it. Held, both reuse it as predicted.
    for rid in ("r2", "r3"):
        assert out[rid].cached_tokens == 60 * 512
        assert out[rid].ttft_s == pytest.approx(decisions[rid].predicted_ttft_s, rel=0.1)
        assert out[rid].ttft_s < 0.3


@pytest.mark.parametrize("warmup", [True, False])
def test_a_doomed_requests_warmup_lets_the_next_one_sharing_its_prefix_in(warmup: bool) -> None:
    p = tuple(range(1, 61))  # 60 blocks: ~1.7 s to prefill cold, against a 1 s TTFT SLO
    trace = [tr(0, 0.0, (*p, 1000), 2), tr(1, 5.0, (*p, 1001), 2)]
    s = settings(admission=AdmissionMode.EARLY)
    adm = replace(
        s.admission,
        best_effort=replace(s.admission.best_effort, enabled=False),
        doomed_warmup=replace(s.admission.doomed_warmup, enabled=warmup),
    )
    s = replace(s, slo=SLOSettings(ttft_s=1.0, tbt_s=0.1), admission=adm)
    sim = Simulator(s, FleetSpec(prefill=2, decode=1, profile=PROFILE), trace)
    result = sim.run()
    r0, r1 = result.requests
    assert r0.outcome is Outcome.REJECTED and r0.reason == "ttft_slo"
    assert result.extra["doomed_warmups"] == int(warmup)
    if warmup:  # the warm-up computed the prefix: r1 reuses it and meets the SLO
        assert r1.outcome is Outcome.COMPLETED and r1.cached_tokens == 60 * 512
        assert r1.ttft_s is not None and r1.ttft_s < 1.0
    else:  # doomed in turn
        assert r1.outcome is Outcome.REJECTED
    assert len(result.requests) == 2  # the warm-up is not reported as a request
    assert not sim.conductor.requests
    assert all(inst.idle for inst in sim.conductor.instances.values())
