"""How long an engine may stay silent: predictions and SLOs, bounded, plus a whole answer's
generation time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from config.settings import ServerSettings
from gateway.silence import silence_timeout_s

SERVER = ServerSettings()  # defaults: 4x the prediction, 3x the SLO, within 30..300 s


def timeout(predicted: float, slo: float, tokens: int = 0, tbt: float = 0.0) -> float:
    d = SimpleNamespace(
        predicted_ttft_s=predicted, slo_ttft_s=slo, predicted_tbt_s=tbt, slo_tbt_s=0.1
    )
    return silence_timeout_s(SERVER, d, tokens)  # type: ignore[arg-type]


def test_the_silence_timeout_follows_prediction_and_slo_within_bounds() -> None:
    assert (SERVER.silence_min_s, SERVER.silence_max_s) == (30.0, 300.0)
    assert timeout(0.1, 0.2) == 30.0  # a fast prediction cannot make it tiny
    assert timeout(20.0, 5.0) == 80.0  # 4 x predicted TTFT (a long queue)
    assert timeout(1.0, 40.0) == 120.0  # 3 x the TTFT SLO
    assert timeout(500.0, 5.0) == 300.0  # bounded above


def test_a_whole_answer_adds_its_generation_time_for_any_max_tokens() -> None:
    # A whole answer comes after its last token: its generation time is added, beyond the
    # ceiling too (4 x 0.5 s predicted TBT > 3 x 0.1 s SLO TBT, for 1,000 tokens).
    assert timeout(0.1, 0.2, tokens=1000, tbt=0.5) == pytest.approx(30.0 + 2000.0)
    assert timeout(500.0, 5.0, tokens=100, tbt=0.01) == pytest.approx(300.0 + 30.0)
    assert timeout(0.1, 0.2, tokens=10**400, tbt=0.5) < float("inf")  # any client max_tokens
