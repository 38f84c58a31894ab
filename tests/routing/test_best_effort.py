"""Best-effort admission on a real Conductor: a prompt that misses the TTFT SLO even on an
idle instance is served late only when it starts at once, enough of the pool is idle and
such prompts are measured to pay for themselves; the TBT check still applies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import AdmissionMode, AdmissionSettings, BestEffortSettings, SLOSettings
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RejectReason
from tests.routing.fleet import busy, fleet_settings, prompt, request

SLO = SLOSettings(ttft_s=0.01, tbt_s=0.1)  # 64 blocks of 16 tokens take longer than that


def settings(mode: AdmissionMode, slo: SLOSettings = SLO, **best_effort: object):
    adm = AdmissionSettings(mode=mode, best_effort=BestEffortSettings(**best_effort))  # type: ignore[arg-type]
    return replace(fleet_settings(slo=slo), admission=adm)


def conductor(mode: AdmissionMode = AdmissionMode.EARLY, **best_effort: object) -> Conductor:
    return Conductor(settings(mode, **best_effort))


def decide(c: Conductor, rid: str, blocks: tuple[int, ...], now: float = 0.0, **kw):
    req = request(rid, blocks, now=now, **kw)
    out = c.schedule(req, now)
    if isinstance(out, Decision):
        c.dispatched(out, req, now)
    return out


def test_the_prompt_is_doomed_even_on_an_idle_instance() -> None:
    c = conductor(enabled=False)
    assert c.instances["p0"].predictors.prefill.predict(64 * 16, 0) > 0.01
    r = decide(c, "r", prompt(1, 64))
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


@pytest.mark.parametrize("mode", [AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])
def test_served_late_on_an_idle_fleet(mode: AdmissionMode) -> None:
    c = conductor(mode)
    d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision) and d.best_effort
    assert d.predicted_ttft_s > 0.009  # the prediction is kept: it misses, and says so
    assert c.stats.best_effort == 1 and c.stats.decisions == 1
    assert c.best_effort.reuse.watched == 1


def test_a_request_that_can_meet_the_slo_is_not_best_effort() -> None:
    c = Conductor(settings(AdmissionMode.EARLY, SLOSettings(ttft_s=30.0, tbt_s=0.1)))
    d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision) and not d.best_effort
    assert c.best_effort.reuse.watched == 0


def test_never_ahead_of_a_queue() -> None:
    c = conductor()
    for p in ("p0", "p1", "p2"):
        busy(c, p, 0.001)  # every instance has work waiting, however little
    r = decide(c, "r", prompt(1, 64))
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert c.stats.best_effort == 0


def test_never_ahead_of_a_booked_prefill_the_books_think_done() -> None:
    """A prefill booked earlier whose predicted end has passed (its prefix pull is late, say)
    still holds the instance: the engine will run it, and a long prefill must not cut in."""
    c = conductor()
    for p in ("p1", "p2"):
        c.remove_instance(p, 0.0)
    busy(c, "p0", 0.001)  # booked at 0, predicted done at 0.001, never reported done
    r = decide(c, "r", prompt(1, 64), now=1.0)
    assert c.instances["p0"].queue_time(1.0) == 0.0
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


def test_needs_the_idle_share_of_the_pool() -> None:
    for share, admitted in ((0.25, True), (0.5, False)):
        c = conductor(idle_share=share)
        busy(c, "p1", 5.0)
        busy(c, "p2", 5.0)  # one of three prefill instances idle
        d = decide(c, "r", prompt(1, 64))
        assert isinstance(d, Decision) is admitted, share


def test_stops_when_such_prompts_are_measured_not_to_pay() -> None:
    c = conductor(reuse_horizon_s=10.0, min_reuse=0.4)
    d = decide(c, "r0", prompt(1, 64))  # served late on the prior (1 of 2)
    assert isinstance(d, Decision) and d.best_effort
    c.failed("r0", 0.5)  # free the instance (the outcome does not matter here)
    busy(c, "p2", 30.0, now=20.0)  # two of three idle: the measurement decides
    # its horizon passed and no later request extended it: 1 of 3 < 0.4
    r = decide(c, "r1", prompt(2, 64), now=20.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
    assert c.best_effort.reuse.rate == pytest.approx(1 / 3)
    # ... unless nothing else could use the fleet: a fully idle pool never turns it away
    c2 = conductor(reuse_horizon_s=10.0, min_reuse=0.99)
    d = decide(c2, "r", prompt(3, 64), now=20.0)
    assert isinstance(d, Decision) and d.best_effort


def test_keeps_going_when_later_turns_extend_them() -> None:
    c = conductor(reuse_horizon_s=10.0, min_reuse=0.4)
    for i in range(6):
        t = float(i) * 20.0
        d = decide(c, f"r{i}", prompt(i + 1, 64), now=t)
        assert isinstance(d, Decision) and d.best_effort, i
        c.failed(f"r{i}", t + 0.5)
        # the session's next turn extends it (cached now, so it is not doomed itself)
        c.best_effort.reuse.observe(prompt(i + 1, 80), t + 1.0)
    assert c.best_effort.reuse.rate == pytest.approx(6 / 7)
    busy(c, "p2", 30.0, now=200.0)  # not fully idle: the measurement decides
    d = decide(c, "late", prompt(50, 64), now=200.0)
    assert isinstance(d, Decision) and d.best_effort


def test_the_tbt_check_still_applies() -> None:
    c = conductor()
    r = decide(c, "r", prompt(1, 64), slo_tbt_s=0.0001)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO


@pytest.mark.parametrize("mode", [AdmissionMode.NONE, AdmissionMode.PEER])
def test_other_modes_are_untouched(mode: AdmissionMode) -> None:
    policy = "sglang_cache_aware" if mode is AdmissionMode.PEER else "kvcache_centric"
    s = settings(mode)
    c = Conductor(replace(s, routing=replace(s.routing, policy=policy)))
    d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision) and not d.best_effort
    assert c.best_effort.reuse.watched == 0


def test_withdrawn_decisions_are_not_counted() -> None:
    c = conductor()
    d = c.schedule(request("r", prompt(1, 64)), 0.0)
    assert isinstance(d, Decision) and d.best_effort
    c.withdraw(d, Rejection("r", RejectReason.TTFT_SLO, "tenant over its share", 1.0))
    assert (c.stats.decisions, c.stats.best_effort) == (0, 0)


def test_live_reconfiguration_keeps_the_measurement() -> None:
    c = conductor()
    decide(c, "r", prompt(1, 64))
    reuse = c.best_effort.reuse
    s = c.settings
    off = replace(s.admission, best_effort=replace(s.admission.best_effort, enabled=False))
    c.apply_settings(replace(s, admission=off))
    assert c.best_effort.reuse is reuse
    r = decide(c, "r2", prompt(2, 64), now=1.0)
    assert isinstance(r, Rejection)
    longer = replace(off.best_effort, enabled=True, reuse_horizon_s=600.0)
    c.apply_settings(replace(s, admission=replace(off, best_effort=longer)))
    assert c.best_effort.reuse is not reuse  # a new horizon measures afresh


def test_a_clients_own_deadline_stays_hard() -> None:
    c = conductor()
    r = decide(c, "r", prompt(1, 256), slo_ttft_s=0.05)  # 4k tokens: ~0.1 s idle
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
