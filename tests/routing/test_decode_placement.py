"""Predictive admission's decode check (routing/decode_placement.py ``predictive_tbt``): the
forecast for when the request reaches decode, never below today's load on any instance, and
with late decode binding the best such check in the pool. Real Conductor, real predictors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import AdmissionMode, PDProtocol, SLOSettings
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RejectReason
from tests.routing.fleet import fleet_settings, make_conductor, prompt, request


def decide(c: Conductor, rid: str, blocks: tuple[int, ...], now: float = 0.0):
    return c.schedule(request(rid, blocks, now=now), now)


def _loaded(mode: AdmissionMode, *, finishing: bool) -> Conductor:
    """One decode instance; 128 running sequences with long contexts, or (finishing=False)
    none running but 128 already dispatched to it and arriving at 0.01 s."""
    from routing.instance_books import DecodeWork

    c = make_conductor(
        prefill=1, decode=1, admission=mode, slo=SLOSettings(ttft_s=30.0, tbt_s=0.02)
    )
    d0 = c.instances["d0"]
    for i in range(128):
        d0.add_incoming(DecodeWork(f"old{i}", 3000, 1, 0.0 if finishing else 0.01))
        if finishing:
            d0.start_decode(f"old{i}", 0.0)  # each one token from done
    return c


def test_predictive_never_credits_departures_below_todays_load() -> None:
    # A full batch predicted to finish before the request's 16k-token prefill ends: Mooncake's
    # forecast would admit; kvgate's predictive check stays at today's load (issue 11: the
    # departure credit is claimed twice and biased admission toward long prompts).
    early = _loaded(AdmissionMode.EARLY, finishing=True)
    predictive = _loaded(AdmissionMode.PREDICTIVE, finishing=True)
    blocks = prompt(5, 1024)
    r = decide(early, "r", blocks)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    r = decide(predictive, "r", blocks)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    assert r.predicted_tbt_s == pytest.approx(early.instances["d0"].tbt_now(1, 1024 * 16))


def test_predictive_rejects_what_early_admits_when_arrivals_will_crowd_the_decode() -> None:
    # Nothing runs yet, so today's TBT is fine; 128 long requests land before this one does.
    early = _loaded(AdmissionMode.EARLY, finishing=False)
    predictive = _loaded(AdmissionMode.PREDICTIVE, finishing=False)
    blocks = prompt(5, 64)
    d = decide(early, "r", blocks)
    assert isinstance(d, Decision), d
    r = decide(predictive, "r", blocks)
    assert isinstance(r, Rejection) and r.reason is RejectReason.TBT_SLO
    assert r.predicted_tbt_s > 0.02 > d.predicted_tbt_s


@pytest.mark.parametrize(
    ("rebind", "protocol"),
    [(True, PDProtocol.VLLM), (False, PDProtocol.VLLM), (True, PDProtocol.SGLANG)],
)
def test_predictive_with_late_binding_asks_whether_any_decode_instance_will_take_it(
    rebind: bool, protocol: PDProtocol
) -> None:
    # d0, the committed-load choice, has 128 long requests landing before this one does; d1
    # has 130 on their way too, but they land long after it. Decided again at prefill
    # completion (late binding), the decode can go to d1, so predictive admits; bound up
    # front to d0 (late binding off, or SGLang's P/D, whose decode leg leaves with the
    # prefill's), it rejects. A d1 whose load runs today and is predicted to finish first
    # would not do: no instance's check goes below its own today's TBT.
    from routing.instance_books import DecodeWork

    settings = fleet_settings(
        prefill=1,
        decode=2,
        admission=AdmissionMode.PREDICTIVE,
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.02),
        routing=replace(fleet_settings().routing, decode_rebind=rebind),
    )
    pools = tuple(
        replace(p, instances=tuple(replace(i, protocol=protocol) for i in p.instances))
        for p in settings.pools
    )
    c = Conductor(replace(settings, pools=pools))
    d0, d1 = c.instances["d0"], c.instances["d1"]
    for i in range(130):
        if i < 128:
            d0.add_incoming(DecodeWork(f"soon{i}", 3000, 1, 0.01))
        d1.add_incoming(DecodeWork(f"later{i}", 3000, 1, 100.0))
    assert d0.committed_key < d1.committed_key  # d0 is the planned one
    out = decide(c, "r", prompt(5, 64))
    if rebind and protocol is PDProtocol.VLLM:
        assert isinstance(out, Decision) and out.decode == "d0", out
    else:
        assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
        assert out.predicted_tbt_s > 0.02


def test_predictive_takes_no_departure_credit_on_the_other_decode_instances_either() -> None:
    # As above, but d1's 130 run today, each predicted one token from done: its forecast
    # would take them all off; its check stays at today's TBT, too slow, so it rejects.
    from routing.instance_books import DecodeWork

    slo = SLOSettings(ttft_s=30.0, tbt_s=0.02)
    c = make_conductor(prefill=1, decode=2, admission=AdmissionMode.PREDICTIVE, slo=slo)
    d0, d1 = c.instances["d0"], c.instances["d1"]
    for i in range(130):
        if i < 128:
            d0.add_incoming(DecodeWork(f"soon{i}", 3000, 1, 0.01))
        d1.add_incoming(DecodeWork(f"old{i}", 3000, 1, 0.0))
        d1.start_decode(f"old{i}", 0.0)
    at = 0.1
    assert d1.forecast(at, 0.0, 1024).tbt_s < 0.018 < d1.tbt_now(1, 1024)
    out = decide(c, "r", prompt(5, 64))
    assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
