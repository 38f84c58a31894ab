"""Admission's decode check (routing/decode_placement.py): predictive's forecast for when the
request reaches decode (``predictive_tbt``), never below today's load on any instance, with late
decode binding the best such check in the pool; and, when the planned instance fails the check,
the instance of the pool that passes it (``tbt_fallback``). Real Conductor, real predictors."""

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
    # completion (late binding), the decode can go to d1, so predictive admits on d0's plan;
    # bound up front (late binding off, or SGLang's P/D, whose decode leg leaves with the
    # prefill's), the check fails on d0 and passes on d1, so the decode goes to d1
    # (``tbt_fallback``). A d1 whose load runs today and is predicted to finish first would
    # not do: no instance's check goes below its own today's TBT.
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
    assert isinstance(out, Decision), out
    # Decided again at prefill completion, d0 stays the plan; bound up front, the failing
    # check on d0 moves the decode to d1 before admission would turn the request away.
    assert out.decode == ("d0" if rebind and protocol is PDProtocol.VLLM else "d1")


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


def _busy_today_light_committed(mode: AdmissionMode) -> Conductor:
    """d0: 100 long sequences running today; d1: none running, 130 dispatched to it that
    land at 100 s. d0 has the lower committed load, d1 the lighter batch today."""
    from routing.instance_books import DecodeWork

    slo = SLOSettings(ttft_s=30.0, tbt_s=0.02)
    c = make_conductor(prefill=1, decode=2, admission=mode, slo=slo)
    d0, d1 = c.instances["d0"], c.instances["d1"]
    for i in range(130):
        if i < 100:
            d0.add_incoming(DecodeWork(f"run{i}", 3000, 10, 0.0))
            d0.start_decode(f"run{i}", 0.0)
        d1.add_incoming(DecodeWork(f"later{i}", 3000, 10, 100.0))
    return c


@pytest.mark.parametrize("mode", [AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])
def test_a_failing_check_on_the_planned_instance_moves_the_decode_to_one_that_passes(
    mode: AdmissionMode,
) -> None:
    # Placement by committed load plans d0, whose batch today is too slow for the request;
    # d1's is not (today's TBT, in both modes: a late rebind guards the rest).
    c = _busy_today_light_committed(mode)
    d0, d1 = c.instances["d0"], c.instances["d1"]
    tokens = 16 * 64
    assert d0.committed_key < d1.committed_key
    assert d1.tbt_now(1, tokens) < 0.018 < d0.tbt_now(1, tokens)
    out = decide(c, "r", prompt(5, 64))
    assert isinstance(out, Decision), out
    assert out.decode == "d1"
    assert out.predicted_tbt_s == pytest.approx(d1.tbt_now(1, tokens))
    assert c.stats.tbt_moves == 1


def test_no_decode_instance_passes_so_the_rejection_names_the_planned_one() -> None:
    c = _busy_today_light_committed(AdmissionMode.EARLY)
    d1 = c.instances["d1"]
    from routing.instance_books import DecodeWork

    for i in range(100):  # d1 as slow as d0 today
        d1.add_incoming(DecodeWork(f"now{i}", 3000, 1000, 0.0))
        d1.start_decode(f"now{i}", 0.0)
    out = decide(c, "r", prompt(5, 64))
    assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
    assert out.predicted_tbt_s == pytest.approx(c.instances["d0"].tbt_now(1, 16 * 64))


def test_a_long_prompt_failing_on_the_planned_instance_is_not_moved() -> None:
    # The decode reservation grades prompts above its ``from_quantile`` rank: at overload
    # those are the costly admissions it holds room against, and moving them to wherever
    # today's batch is light cost up to 4 % goodput on the decode-bound conversation 2023
    # points. Only prompts it never grades move.
    from routing.admission import _for_model
    from routing.decode_reservation import DecodeReservation

    c = _busy_today_light_committed(AdmissionMode.EARLY)
    admission = c.admission
    reservation = _for_model(
        admission.reservations,
        None,
        DecodeReservation,
        admission.settings.decode_reservation,
    )
    for _ in range(20):  # recent prompts all shorter than this one
        reservation.record(16 * 8, True)
    out = decide(c, "r", prompt(5, 64))
    assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
    short = decide(c, "s", prompt(6, 4))  # as short as the recent ones: moved
    assert isinstance(short, Decision) and short.decode == "d1", short


def _colocated_with_a_decode(**sections: object) -> Conductor:
    """One colocated instance running one decode that made 9 of its ~10 tokens in 0.5 s:
    0.4 s of its TBT budget saved, little more to come."""
    from routing.instance_books import DecodeWork

    c = make_conductor(
        prefill=0, decode=0, colocated=1, admission=AdmissionMode.PREDICTIVE, **sections
    )
    c0 = c.instances["c0"]
    c0.add_incoming(DecodeWork("old", 1000, 10, 0.0))
    c0.start_decode("old", 0.0)
    c0.add_tokens("old", 9, 0.5)
    return c


def test_colocated_check_turns_away_a_prefill_that_would_stall_a_decode_past_its_slo() -> None:
    c = _colocated_with_a_decode()
    # 32k tokens: ~1 s of prefill in chunk steps, more than the running decode has saved.
    long = decide(c, "long", prompt(1, 2000), now=0.5)
    assert isinstance(long, Rejection) and long.reason is RejectReason.TBT_SLO
    assert long.predicted_tbt_s is not None and long.predicted_tbt_s > 0.1
    short = decide(c, "short", prompt(2, 4), now=0.5)  # a few ms: the decode absorbs it
    assert isinstance(short, Decision) and short.decode == "c0"


def test_colocated_check_off_admits_the_stalling_prefill() -> None:
    from config.admission_settings import PrefillStallSettings

    c = _colocated_with_a_decode()
    admission = replace(c.settings.admission, prefill_stall=PrefillStallSettings(enabled=False))
    c.apply_settings(replace(c.settings, admission=admission))
    assert isinstance(decide(c, "long", prompt(1, 2000), now=0.5), Decision)


def test_a_colocated_decision_predicts_its_step_stretched_by_the_recent_prefills() -> None:
    """Reported: the TBT with the stalls of the prefills that run beside the decode (the
    instance's recent prefill share); checked: the decode-only TBT and the stall this
    prefill leaves, as before."""
    c = _colocated_with_a_decode()
    c0 = c.instances["c0"]
    c0.enqueue_prefill("done", 4.0, 100, now=0.0, ready_s=0.0)
    c0.finish_prefill("done", 0.5)
    d = decide(c, "short", prompt(2, 4), now=0.5)
    assert isinstance(d, Decision) and d.decode == "c0"
    u = c0.prefill_share(0.5)
    assert u > 0.1
    assert d.predicted_tbt_s == pytest.approx(c0.tbt_now(1, d.prompt_tokens) * (1 + u))
    twin = decide(_colocated_with_a_decode(), "short", prompt(2, 4), now=0.5)
    assert isinstance(twin, Decision)  # the same, without the recent prefill: the same check
    assert d.checked_tbt_s is not None and d.checked_tbt_s == twin.checked_tbt_s
    assert twin.predicted_tbt_s == pytest.approx(c0.tbt_now(1, d.prompt_tokens))
