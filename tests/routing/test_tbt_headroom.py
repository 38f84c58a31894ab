"""The TBT headroom in force, learned from the decodes' outcomes (routing/tbt_headroom.py), and
how admission, the Conductor's books and the simulator use it. Real types throughout."""

from __future__ import annotations

from dataclasses import replace

from config.admission_settings import TBTHeadroomSettings
from config.settings import AdmissionMode
from replay.sim.fleet import FleetSpec
from replay.sim.simulator import Simulator
from replay.workload.traces import TraceRequest
from routing.admission import Admission, EffectiveSLO, resolve_slo
from routing.tbt_headroom import TBTHeadroomControl
from routing.types import Decision
from tests.routing.fleet import fleet_settings, make_conductor, prompt, request

SETTINGS = TBTHeadroomSettings(window=10, target_miss=0.1, raise_step=0.5, lower_step=0.25)


def _window(c: TBTHeadroomControl, misses: int, n: int = 10) -> None:
    for i in range(n):
        c.observe(i < misses)


def test_a_clean_window_lowers_the_share_and_misses_raise_it() -> None:
    c = TBTHeadroomControl(SETTINGS)
    _window(c, 0)
    assert c.share == 0.75 and c.lowered == 1
    _window(c, 0)
    _window(c, 0)
    _window(c, 0)
    _window(c, 0)  # floored at min_share
    assert c.share == 0.0 and c.lowered == 4
    _window(c, 1)  # 10 %: not over the target, not under half of it: no move
    assert c.share == 0.0
    _window(c, 2)  # 20 % > 10 %
    assert c.share == 0.5 and c.raised == 1
    _window(c, 5)
    _window(c, 5)
    assert c.share == 1.0 and c.raised == 2  # capped at the configured headroom


def test_nothing_moves_before_a_window_fills_or_when_not_adaptive() -> None:
    c = TBTHeadroomControl(SETTINGS)
    _window(c, 0, n=9)
    assert c.share == 1.0
    fixed = TBTHeadroomControl(replace(SETTINGS, adaptive=False))
    _window(fixed, 0, n=50)
    assert fixed.share == 1.0 and fixed.lowered == 0


def test_the_limit_keeps_the_share_of_the_class_headroom() -> None:
    s = fleet_settings().slo
    slo = resolve_slo(request("r", prompt(1, 4)), s)  # normal: 10 % headroom
    assert abs(slo.tbt_limit_s - 0.09) < 1e-12
    slo.tbt_share = 0.5
    assert abs(slo.tbt_limit_s - 0.095) < 1e-12
    assert abs(slo.ttft_limit_s - 27.0) < 1e-9  # the TTFT headroom is not learned
    low = EffectiveSLO(s.priority("low"), 30.0, 0.1, tbt_share=0.5)
    assert low.tbt_limit_s < slo.tbt_limit_s  # lower classes are still shed first


def test_only_the_slo_modes_learn() -> None:
    s = replace(fleet_settings().admission, tbt_headroom=SETTINGS)
    for mode, learns in ((AdmissionMode.PREDICTIVE, True), (AdmissionMode.NONE, False)):
        a = Admission(replace(s, mode=mode))
        for _ in range(10):
            a.observe_decode(None, False)
        assert (a.headroom_for(None).share < 1.0) is learns


def _dispatched(c, rid: str, now: float = 0.0) -> Decision:
    d = c.schedule(request(rid, prompt(3, 8)), now)
    assert isinstance(d, Decision)
    c.dispatched(d, request(rid, prompt(3, 8)), now)
    return d


def test_the_books_count_streamed_decodes_and_refusals() -> None:
    c = make_conductor(admission=AdmissionMode.PREDICTIVE)
    control = c.admission.headroom_for(None)
    _dispatched(c, "slow")
    c.first_token("slow", 1.0)
    c.finished("slow", 11.0, output_tokens=11)  # 1 s per token: over the 100 ms SLO
    _dispatched(c, "fast")
    c.first_token("fast", 1.0)
    c.finished("fast", 2.0, output_tokens=11)
    _dispatched(c, "whole")
    c.first_token("whole", 10.0)  # a non-streamed answer: no TBT to judge
    c.finished("whole", 10.0, output_tokens=11, decode_timed=False)
    _dispatched(c, "refused")
    c.first_token("refused", 1.0)
    c.failed("refused", 1.5, decode_refused=True)
    _dispatched(c, "lost")
    c.failed("lost", 1.5)  # not a TBT outcome
    assert (control.outcomes.seen, control.outcomes.missed) == (3, 2)


def test_the_simulator_spends_the_headroom_where_nothing_is_missed() -> None:
    """A decode-bound fleet (LLaMA2-70B, 2023: its engines and predictor agree): the decodes
    admitted keep their TBT SLO, so the share falls and more requests meet their SLOs."""
    trace = [
        TraceRequest(i, i * 0.5, 6144 + 512 * (i % 7), 200 + 30 * (i % 5), ()) for i in range(800)
    ]
    fleet = FleetSpec(prefill=8, decode=2, profile="llama2-70b-a100-tp8-2023")
    base = fleet_settings(prefill=0, decode=0, admission=AdmissionMode.PREDICTIVE)
    runs = {}
    for adaptive in (True, False):
        control = TBTHeadroomSettings(adaptive=adaptive, window=50)
        res = Simulator(
            replace(base, admission=replace(base.admission, tbt_headroom=control)), fleet, trace
        ).run()
        met = sum(r.meets_slo(30.0, 0.1) for r in res.requests)
        completed = sum(r.outcome.name == "COMPLETED" for r in res.requests)
        runs[adaptive] = (res.extra["tbt_headroom_share"], met, completed)
    assert runs[False][0] == 1.0 and runs[True][0] < 1.0
    assert runs[True][1] > runs[False][1]
    assert runs[True][1] == runs[True][2]  # every decode admitted kept its SLOs
