"""The capacity gauges of a gateway (gateway/capacity_loop.py): fed from the decision log, the
books and the refusal counters on the scrape round, no network needed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import AdmissionMode, InstanceSettings, PoolSettings, Role, Settings
from gateway.learning import DecisionRecord
from gateway.runtime import Gateway
from routing.capacity import DemandSample, DemandWindow, PoolModel, instances_needed
from routing.types import Decision, RequestInfo


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _gateway(clock: _Clock) -> Gateway:
    base = Settings()
    pools = (
        PoolSettings(
            "pre", Role.PREFILL, (InstanceSettings("p0", "http://127.0.0.1:1", Role.PREFILL),)
        ),
        PoolSettings(
            "dec",
            Role.DECODE,
            (
                InstanceSettings("d0", "http://127.0.0.1:2", Role.DECODE),
                InstanceSettings("d1", "http://127.0.0.1:3", Role.DECODE),
            ),
        ),
    )
    # Admission off: every request is placed, so the demand is exactly what the test sends.
    settings = replace(
        base,
        pools=pools,
        slo=replace(base.slo, ttft_s=2.0),
        admission=replace(base.admission, mode=AdmissionMode.NONE),
    )
    return Gateway(settings, clock=clock)


def _admit(gw: Gateway, i: int, prompt: int, now: float) -> Decision:
    info = RequestInfo(f"r{i}", prompt, (), 300, now)
    d = gw.conductor.schedule(info, now)
    assert isinstance(d, Decision), d
    gw.conductor.dispatched(d, info, now)
    gw.learner.record(
        DecisionRecord(
            info.request_id,
            now,
            d.prefill,
            d.decode,
            d.priority,
            d.reason,
            d.prompt_tokens,
            d.cached_tokens,
            d.predicted_ttft_s,
            d.predicted_tbt_s,
        )
    )
    return d


def _gauge(gw: Gateway, name: str, pool: str) -> float | None:
    return gw.metrics.registry.get_sample_value(name, {"pool": pool})


def test_gauges_follow_the_demand_and_match_the_formula() -> None:
    clock = _Clock()
    gw = _gateway(clock)
    gw._publish_gauges()  # the first round: no demand yet
    assert _gauge(gw, "kvgate_pool_instances_needed", "pre") == 0
    assert _gauge(gw, "kvgate_pool_instances", "pre") == 1
    assert _gauge(gw, "kvgate_pool_instances", "dec") == 2
    decisions = []
    for i in range(40):  # 40 requests of 12000 tokens over 10 s
        clock.t = i * 0.25
        decisions.append(_admit(gw, i, 12_000, clock.t))
    clock.t = 10.0
    gw._publish_gauges()
    needed_pre = _gauge(gw, "kvgate_pool_instances_needed", "pre")
    needed_dec = _gauge(gw, "kvgate_pool_instances_needed", "dec")
    # The same window computed directly from the decisions and the instances' predictors.
    w = DemandWindow(10.0)
    w.start(0.0)
    for d in decisions:
        out = d.predicted_output_tokens
        w.add(DemandSample(0.0, d.prompt_tokens, d.cached_tokens, out, "pre", "dec"))
    p0, d0 = gw.conductor.instances["p0"], gw.conductor.instances["d0"]
    pools = [
        PoolModel(
            "pre", Role.PREFILL, 1, p0.predictors.prefill, p0.predictors.decode, 1, p0.max_batch
        ),
        PoolModel(
            "dec",
            Role.DECODE,
            2,
            d0.predictors.prefill,
            d0.predictors.decode,
            d0.capacity_tokens,
            d0.max_batch,
        ),
    ]
    want = instances_needed(w, pools, 10.0, ttft_slo_s=2.0, tbt_slo_s=gw.settings.slo.tbt_s)
    assert needed_pre == want["pre"].needed >= 1
    assert needed_dec == want["dec"].needed >= 1
    load = _gauge(gw, "kvgate_pool_load_instances", "pre")
    assert load == pytest.approx(want["pre"].load_instances)
    # Twice the demand in the next window: the prefill count grows (about doubles).
    for i in range(40, 120):
        clock.t = 10.0 + (i - 40) * 0.125
        _admit(gw, i, 12_000, clock.t)
        gw.conductor.finished(f"r{i}", clock.t)  # gone from the books before the round reads it
    clock.t = 20.0
    gw._publish_gauges()
    doubled = _gauge(gw, "kvgate_pool_load_instances", "pre")
    assert doubled == pytest.approx(2 * load, rel=0.05)
    assert _gauge(gw, "kvgate_pool_instances_needed", "pre") >= needed_pre
    # finished requests counted with the mean expected output of those read before
    assert _gauge(gw, "kvgate_pool_load_instances", "dec") > 0


def test_refusals_raise_the_count() -> None:
    clock = _Clock()
    gw = _gateway(clock)
    gw._publish_gauges()
    for i in range(20):
        clock.t = i * 0.5
        _admit(gw, i, 12_000, clock.t)
    clock.t = 10.0
    gw._publish_gauges()
    before = _gauge(gw, "kvgate_pool_load_instances", "pre")
    gw.conductor.stats.rejections["ttft_slo"] = 20  # as many turned away as admitted
    gw._publish_gauges()
    assert _gauge(gw, "kvgate_pool_load_instances", "pre") == pytest.approx(2 * before)


def test_a_drained_instance_leaves_the_pool_count() -> None:
    gw = _gateway(_Clock())
    gw.conductor.drain_instance("d1")
    gw._publish_gauges()
    assert _gauge(gw, "kvgate_pool_instances", "dec") == 1


def test_a_pool_that_leaves_the_configuration_leaves_the_metrics() -> None:
    gw = _gateway(_Clock())
    gw._publish_gauges()
    gw.remove_instance("p0")  # the prefill pool is now empty
    gw._publish_gauges()
    assert _gauge(gw, "kvgate_pool_instances", "pre") is None
    assert _gauge(gw, "kvgate_pool_instances_needed", "pre") is None
    assert _gauge(gw, "kvgate_pool_instances", "dec") == 2


def test_the_learned_tbt_headroom_wait_margin_rebinds_and_tbt_moves_are_published() -> None:
    clock = _Clock()
    gw = _gateway(clock)
    settings = replace(gw.settings.admission, mode=AdmissionMode.PREDICTIVE)
    gw.conductor.admission.settings = settings
    for _ in range(settings.tbt_headroom.window):  # a window of decodes, none missed
        gw.conductor.admission.observe_decode(None, False)
    for _ in range(settings.wait_margin.window):  # a window of first tokens, all late
        gw.conductor.admission.observe_first_token(None, True)
    gw.conductor.stats.rebinds = 3
    gw.conductor.stats.tbt_moves = 5
    gw._publish_gauges()
    share = gw.metrics.registry.get_sample_value("kvgate_tbt_headroom_share", {"model": ""})
    assert share == pytest.approx(0.9)
    margin = gw.metrics.registry.get_sample_value("kvgate_wait_margin", {"model": ""})
    assert margin == pytest.approx(3.0)  # 100 % late: x (1 + 2 x 1)
    assert gw.metrics.registry.get_sample_value("kvgate_decode_rebinds") == 3
    assert gw.metrics.registry.get_sample_value("kvgate_decode_tbt_moves") == 5
