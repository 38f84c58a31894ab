from __future__ import annotations

import pytest

from config.settings import AdmissionMode, AdmissionSettings, PriorityClass, SLOSettings
from routing.admission import Admission, UnknownPriority, resolve_slo
from routing.types import RejectReason
from tests.routing.fleet import prompt, request

SLO = SLOSettings(
    ttft_s=2.0,
    tbt_s=0.1,
    priorities=(
        PriorityClass("gold", 2, 0.0, ttft_s=1.0),
        PriorityClass("std", 1, 0.0),
        PriorityClass("batch", 0, 0.5),
    ),
    default_priority="std",
)


def req(**kw):
    return request("r", prompt(1, 4), **kw)


def test_class_slo_overrides_global_and_request_overrides_class() -> None:
    assert resolve_slo(req(priority="gold"), SLO).ttft_s == 1.0
    assert resolve_slo(req(), SLO).ttft_s == 2.0
    s = resolve_slo(req(priority="gold", slo_ttft_s=3.0, slo_tbt_s=0.05), SLO)
    assert (s.ttft_s, s.tbt_s) == (3.0, 0.05)


def test_unknown_priority_is_an_error_listing_known_classes() -> None:
    with pytest.raises(UnknownPriority, match="gold, std, batch"):
        resolve_slo(req(priority="platinum"), SLO)


@pytest.mark.parametrize("mode", [AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])
def test_checks_ttft_then_tbt(mode: AdmissionMode) -> None:
    a = Admission(AdmissionSettings(mode=mode))
    slo = resolve_slo(req(), SLO)
    assert a.check(req(), slo, 1.9, 0.09, 1.0) is None
    r = a.check(req(), slo, 2.1, 0.5, 1.0)
    assert r is not None and r.reason is RejectReason.TTFT_SLO and r.limit_s == 2.0
    r = a.check(req(), slo, 1.0, 0.11, 3.5)
    assert r is not None and r.reason is RejectReason.TBT_SLO
    assert r.retry_after_s == 3.5 and "TBT" in r.message and "100 ms" in r.message


def test_none_mode_admits_anything() -> None:
    a = Admission(AdmissionSettings(mode=AdmissionMode.NONE))
    assert a.check(req(), resolve_slo(req(), SLO), 100.0, 10.0, 1.0) is None


def test_margin_makes_admission_conservative() -> None:
    a = Admission(AdmissionSettings(mode=AdmissionMode.EARLY, ttft_margin=1.2))
    assert a.check(req(), resolve_slo(req(), SLO), 1.8, 0.01, 1.0) is not None


def test_headroom_sheds_low_priority_first() -> None:
    a = Admission(AdmissionSettings(mode=AdmissionMode.EARLY))
    std, batch = req(), req(priority="batch")
    assert a.check(std, resolve_slo(std, SLO), 1.5, 0.01, 1.0) is None
    r = a.check(batch, resolve_slo(batch, SLO), 1.5, 0.01, 1.0)
    assert r is not None and r.limit_s == 1.0 and r.priority == "batch"


def test_retry_after_is_clamped() -> None:
    a = Admission(AdmissionSettings(mode=AdmissionMode.EARLY, retry_after_max_s=10.0))
    r = a.check(req(), resolve_slo(req(), SLO), 500.0, 0.0, 1.0)
    assert r is not None and r.retry_after_s == 10.0


def test_tbt_floor_is_below_every_tbt_threshold_the_checks_use() -> None:
    from dataclasses import replace

    base = AdmissionSettings(mode=AdmissionMode.PREDICTIVE)
    slo = resolve_slo(req(), SLO)  # std: no headroom, 100 ms
    # The reservation keeps up to 15 % of the limit, best effort wants decode under 80 % of it.
    assert Admission(base).tbt_floor_s(slo) == pytest.approx(0.08)
    no_best_effort = replace(base, best_effort=replace(base.best_effort, enabled=False))
    assert Admission(no_best_effort).tbt_floor_s(slo) == pytest.approx(0.085)
    plain = replace(
        no_best_effort,
        decode_reservation=replace(base.decode_reservation, enabled=False),
        tbt_margin=1.25,
    )
    assert Admission(plain).tbt_floor_s(slo) == pytest.approx(0.08)  # 100 ms / 1.25
    # Just above the floor a check still admits: the floor decides nothing by itself.
    a = Admission(base)
    assert a.check(req(), slo, 0.1, a.tbt_floor_s(slo) * 1.01, 1.0) is None
