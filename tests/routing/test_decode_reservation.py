"""routing/decode_reservation.py: the graded reserve, its overload gate, and what admission does
with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.admission_settings import DecodeReservationSettings
from config.settings import AdmissionMode, AdmissionSettings, SLOSettings
from routing.admission import Admission, resolve_slo
from routing.decode_reservation import DecodeReservation, RecentRank
from routing.types import RejectReason, RequestInfo

SETTINGS = DecodeReservationSettings(
    fraction=0.2,
    from_quantile=0.5,
    window=10,
    min_pressure=0.5,
    pressure_window=4,
    min_admit_ratio=0.0,
)


def test_rank_and_admitted_share_over_the_recent_values() -> None:
    r = RecentRank(window=4)
    assert r.rank(100) == 0.0 and r.admitted_share() == 1.0  # nothing seen yet
    for v, admitted in ((10, True), (20, True), (30, False), (40, True)):
        r.record(v, admitted)
    assert [r.rank(v) for v in (5, 20, 35, 50)] == [0.0, 0.25, 0.75, 1.0]
    assert r.admitted_share() == 0.75 and r.admitted_share(30) == 0.5
    assert r.admitted_share(41) == 1.0  # none that long: nothing to protect
    r.record(50, False)  # 10 leaves the window
    assert len(r) == 4 and r.rank(15) == 0.0 and r.rank(60) == 1.0
    assert r.admitted_share() == 0.5 and r.admitted_share(30) == 1 / 3


def _filled(
    settings: DecodeReservationSettings, fails: bool, admitted: bool = True
) -> DecodeReservation:
    """Ten prompts of 1k..10k tokens seen, every plain TBT check failing (or none)."""
    res = DecodeReservation(settings)
    for k in range(1, 11):
        res.reserve(k * 1000, fails)
        res.record(k * 1000, admitted)
    return res


def test_reserve_grows_with_the_prompts_rank_above_the_quantile() -> None:
    res = _filled(SETTINGS, fails=True)
    assert res.pressure == 1.0
    assert res.reserve(500, True) == 0.0  # shorter than everything seen
    assert res.reserve(5_500, True) == 0.0  # at the median: no reserve
    # 9 of the 10 prompts in the window are shorter: grade (0.9 - 0.5) / 0.5 = 0.8.
    assert res.reserve(9_900, True) == pytest.approx(0.2 * 0.8)
    assert res.reserve(99_000, True) == pytest.approx(0.2)  # the longest: the whole fraction


def test_pressure_counts_the_shorter_prompts_failing_the_plain_check() -> None:
    """The reserve is for the shorter prompts: it acts only while they are being turned away."""
    calm = _filled(SETTINGS, fails=False)
    assert calm.pressure == 0.0 and calm.reserve(99_000, False) == 0.0
    res = _filled(SETTINGS, fails=False)
    for _ in range(10):  # long prompts failing say nothing about the room short ones get
        res.reserve(99_000, True)
    assert res.pressure == 0.0
    # Short prompts failing: over the last ``pressure_window`` (4) of them, two failures.
    for fails in (False, False, False, True, True):
        res.reserve(1, fails)
    assert res.pressure == 0.5 and res.reserve(99_000, True) == pytest.approx(0.2)
    res.reserve(1, False)
    res.reserve(1, False)
    assert res.pressure == 0.5  # the window slid: True, True, False, False
    res.reserve(1, False)
    assert res.pressure == 0.25 and res.reserve(99_000, True) == 0.0  # below min_pressure
    off = DecodeReservation(DecodeReservationSettings(enabled=False))
    assert off.reserve(99_000, True) == 0.0 and off.pressure == 0.0


def test_the_floor_waives_the_reserve_for_prompts_admitted_too_rarely() -> None:
    """Starvation bound: prompts at least this long admitted at under ``min_admit_ratio`` of
    the overall admitted share get the plain check again."""
    floored = replace(SETTINGS, min_admit_ratio=0.5)
    res = DecodeReservation(floored)
    for k in range(1, 11):  # the five longest were all refused, the five shortest admitted
        res.reserve(k * 1000, True)
        res.record(k * 1000, k <= 5)
    assert res.prompts.admitted_share() == 0.5 and res.prompts.admitted_share(9_000) == 0.0
    assert res.reserve(9_900, True) == 0.0  # 0 < 0.5 x 0.5: waived
    res = _filled(floored, fails=True)  # all admitted: nothing starves
    assert res.reserve(9_900, True) == pytest.approx(0.2 * 0.8)


def _req(rid: str, tokens: int) -> RequestInfo:
    return RequestInfo(
        request_id=rid, prompt_tokens=tokens, block_hashes=(), max_tokens=64, arrival_s=0.0
    )


@pytest.mark.parametrize("mode", [AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])
def test_admission_keeps_the_reserve_from_long_prompts_under_overload(
    mode: AdmissionMode,
) -> None:
    adm = Admission(AdmissionSettings(mode=mode, decode_reservation=SETTINGS))
    slo = resolve_slo(_req("x", 1), SLOSettings(ttft_s=5.0, tbt_s=0.1))
    for k in range(1, 11):  # overload: each of these fails the plain TBT check
        rej = adm.check(_req(f"r{k}", k * 1000), slo, 1.0, 0.2, 1.0)
        assert rej is not None and rej.reason is RejectReason.TBT_SLO
    assert adm.turned_away_by_reserve == 0  # the plain check refused them all anyway
    # 85 ms fits the 90 ms limit (100 ms less the default class's 10 % headroom): a short
    # prompt gets it, the longest only 72 ms of it.
    assert adm.check(_req("short", 500), slo, 1.0, 0.085, 1.0) is None
    rej = adm.check(_req("long", 50_000), slo, 1.0, 0.085, 1.0)
    assert rej is not None and rej.reason is RejectReason.TBT_SLO
    assert rej.limit_s == pytest.approx(0.072)
    assert "kept for shorter prompts" in rej.message
    assert adm.turned_away_by_reserve == 1
    # Below the reserve the long prompt gets in: starvation ends where the load drops.
    assert adm.check(_req("long2", 50_000), slo, 1.0, 0.07, 1.0) is None


def test_modes_without_an_slo_check_keep_no_reserve() -> None:
    for mode in (AdmissionMode.NONE, AdmissionMode.PEER):
        adm = Admission(AdmissionSettings(mode=mode, decode_reservation=SETTINGS))
        slo = resolve_slo(_req("x", 1), SLOSettings(ttft_s=5.0, tbt_s=0.1))
        if mode is AdmissionMode.NONE:
            assert adm.check(_req("r", 50_000), slo, 1.0, 0.2, 1.0) is None
        assert adm.reservations == {}


def test_each_model_keeps_its_own_reservation() -> None:
    """One model's decode overload and prompt lengths do not reserve room on another's."""
    adm = Admission(AdmissionSettings(mode=AdmissionMode.EARLY, decode_reservation=SETTINGS))
    slo = resolve_slo(_req("x", 1), SLOSettings(ttft_s=5.0, tbt_s=0.1))
    for k in range(1, 11):  # model a: overloaded, every plain check fails
        adm.check(replace(_req(f"a{k}", k * 1000), model="a"), slo, 1.0, 0.2, 1.0)
    assert adm.reservations["a"].pressure == 1.0
    long_b = replace(_req("b", 50_000), model="b")
    assert adm.check(long_b, slo, 1.0, 0.085, 1.0) is None  # b: no pressure, no reserve
    assert adm.reservations["b"].pressure == 0.0
    rej = adm.check(replace(_req("a-long", 50_000), model="a"), slo, 1.0, 0.085, 1.0)
    assert rej is not None and adm.turned_away_by_reserve == 1


def test_a_retry_is_counted_once() -> None:
    """A request placed again after a failed instance (``retry``) is judged with the reserve but
    not counted again in the windows."""
    adm = Admission(AdmissionSettings(mode=AdmissionMode.EARLY, decode_reservation=SETTINGS))
    slo = resolve_slo(_req("x", 1), SLOSettings(ttft_s=5.0, tbt_s=0.1))
    adm.check(_req("r", 1000), slo, 1.0, 0.2, 1.0)
    res = adm.reservations[None]
    seen = (len(res.prompts), res.pressure)
    adm.check(_req("r", 1000), slo, 1.0, 0.2, 1.0, retry=True)
    assert (len(res.prompts), res.pressure) == seen == (1, 1.0)
