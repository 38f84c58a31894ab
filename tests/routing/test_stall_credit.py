from __future__ import annotations

import pytest

from config.admission_settings import PrefillStallSettings
from routing.stall_credit import StallCreditControl

SETTINGS = PrefillStallSettings(
    credit=0.2, window=10, target_miss=0.1, raise_step=0.05, lower_factor=0.5, max_credit=0.3
)


def feed(control: StallCreditControl, misses: int, total: int = 10) -> None:
    for k in range(total):
        control.observe(k < misses)


def test_starts_at_the_configured_credit_and_moves_once_per_window() -> None:
    c = StallCreditControl.start(SETTINGS)
    assert c.credit == 0.2
    feed(c, 0, 9)
    assert c.credit == 0.2  # the window is not full yet
    c.observe(False)
    assert c.credit == pytest.approx(0.25) and c.raised == 1


def test_a_window_over_the_target_lowers_it_and_a_clean_one_raises_it_to_the_cap() -> None:
    c = StallCreditControl.start(SETTINGS)
    feed(c, 2)  # 20 % > 10 %
    assert c.credit == pytest.approx(0.1) and c.lowered == 1
    feed(c, 1)  # 10 %: neither over the target nor under half of it
    assert c.credit == pytest.approx(0.1)
    for _ in range(10):
        feed(c, 0)
    assert c.credit == pytest.approx(0.3)


def test_fixed_credit_when_not_adaptive() -> None:
    c = StallCreditControl.start(PrefillStallSettings(credit=0.4, adaptive=False, window=2))
    feed(c, 2, 6)
    assert c.credit == 0.4 and c.raised == c.lowered == 0


def test_admission_feeds_it_the_colocated_decodes_only() -> None:
    from config.admission_settings import AdmissionSettings
    from config.settings import AdmissionMode
    from routing.admission import Admission

    settings = AdmissionSettings(mode=AdmissionMode.PREDICTIVE, prefill_stall=SETTINGS)
    a = Admission(settings)
    for _ in range(10):
        a.observe_decode("m", True)  # a P/D decode: not the stall check's to learn from
    assert a.stall_credit_for("m").credit == 0.2
    for _ in range(10):
        a.observe_decode("m", True, stall_missed=False)  # missed, but not for the stalls
    assert a.stall_credit_for("m").credit == pytest.approx(0.25)  # a clean window for it
    for _ in range(10):
        a.observe_decode("m", True, stall_missed=True)
    assert a.stall_credit_for("m").credit == pytest.approx(0.125)
    assert a.stall_credit_for("other").credit == 0.2  # per served model
