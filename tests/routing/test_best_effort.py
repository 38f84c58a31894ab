"""Best-effort admission on a real Conductor: a prompt that misses the TTFT SLO even on an
idle instance is served late only on capacity nobody else uses (its instance has nothing
booked, enough of the pool is idle, its decode instance has room); the TBT check still
applies and a client's own deadline stays hard."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.admission_settings import BestEffortSettings
from config.settings import AdmissionMode, AdmissionSettings, SLOSettings
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


def test_a_request_that_can_meet_the_slo_is_not_best_effort() -> None:
    c = Conductor(settings(AdmissionMode.EARLY, SLOSettings(ttft_s=30.0, tbt_s=0.1)))
    d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision) and not d.best_effort


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


def test_needs_decode_room() -> None:
    """Checked at a TBT above ``max_decode_load`` of the limit: the decode room is not spare."""
    c = conductor()
    tbt = c.instances["d0"].tbt_now(1, 64 * 16)  # what an idle decode instance is checked at
    limit = 0.1 * 0.9  # the TBT SLO less the default class's 10 % headroom
    for load, admitted in ((1.1 * tbt / limit, True), (0.9 * tbt / limit, False)):
        c = conductor(max_decode_load=load)
        d = decide(c, "r", prompt(1, 64))
        assert isinstance(d, Decision) is admitted, load


def test_never_onto_a_decode_instance_past_its_tbt() -> None:
    """``max_decode_load`` <= 1: whatever best effort admits also passes the TBT check."""
    c = conductor(max_decode_load=1.0)
    r = decide(c, "r", prompt(1, 64), slo_tbt_s=0.0001)
    assert isinstance(r, Rejection) and c.stats.best_effort == 0


def test_a_clients_own_deadline_stays_hard() -> None:
    c = conductor()
    r = decide(c, "r", prompt(1, 256), slo_ttft_s=0.05)  # 4k tokens: ~0.1 s idle
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO


@pytest.mark.parametrize("mode", [AdmissionMode.NONE, AdmissionMode.PEER])
def test_other_modes_are_untouched(mode: AdmissionMode) -> None:
    policy = "sglang_cache_aware" if mode is AdmissionMode.PEER else "kvcache_centric"
    s = settings(mode)
    c = Conductor(replace(s, routing=replace(s.routing, policy=policy)))
    d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision) and not d.best_effort


def test_withdrawn_decisions_are_not_counted() -> None:
    c = conductor()
    d = c.schedule(request("r", prompt(1, 64)), 0.0)
    assert isinstance(d, Decision) and d.best_effort
    c.withdraw(d, Rejection("r", RejectReason.TTFT_SLO, "tenant over its share", 1.0))
    assert (c.stats.decisions, c.stats.best_effort) == (0, 0)


def test_switched_off_live() -> None:
    c = conductor()
    s = c.settings
    off = replace(s.admission, best_effort=replace(s.admission.best_effort, enabled=False))
    c.apply_settings(replace(s, admission=off))
    r = decide(c, "r", prompt(1, 64))
    assert isinstance(r, Rejection) and r.reason is RejectReason.TTFT_SLO
