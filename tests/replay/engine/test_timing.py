from __future__ import annotations

import pytest

from predictors.profiles import get_profile
from replay.engine.timing import StepTiming

T = StepTiming.from_profile(get_profile("llama3-8b-h100-tp1"), overhead_ms=0.0)


def test_prefill_grows_as_the_profile_says() -> None:
    # Calibration README samples (GPU ms, Llama-3-8B/H100): 2048 -> 46.9, 8192 -> 214;
    # the mixed-step form U3 has p90 error 6.8 % against them.
    assert T.prefill(2048, 0) * 1e3 == pytest.approx(46.9, rel=0.08)
    assert T.prefill(8192, 0) * 1e3 == pytest.approx(214.0, rel=0.08)
    times = [T.prefill(n, 0) for n in (256, 1024, 4096, 16384)]
    assert times == sorted(times)
    # A cached prefix makes attention over it cost something, but far less than recomputing.
    assert T.prefill(1024, 8192) > T.prefill(1024, 0)
    assert T.prefill(1024, 8192) < T.prefill(9216, 0) / 4


def test_chunking_adds_per_step_overhead_only() -> None:
    whole, chunked = T.prefill(8192, 0), T.prefill(8192, 0, chunk=2048)
    assert chunked > whole
    assert chunked - whole == pytest.approx(3 * T.a_s, rel=0.3)


def test_decode_step_follows_the_step_model() -> None:
    # README: decode ctx 1024, B=32 -> 8.7 ms (D2); U3 with T = B stays within ~10 %.
    assert T.step(32, 0.0, 32 * 1024) * 1e3 == pytest.approx(8.7, rel=0.1)
    assert T.step(256, 0.0, 256 * 1024) > T.step(32, 0.0, 32 * 1024)


def test_decode_segments_sum_their_steps() -> None:
    batch, ctx = 16, 16 * 2000
    total = sum(T.step(batch, 0.0, ctx + i * batch) for i in range(100))
    assert T.decode_steps(batch, ctx, 100) == pytest.approx(total)
    for elapsed in (0.0, 1e-6, 0.05, 0.37, 1.0):
        n = T.decode_steps_until(batch, ctx, elapsed)
        assert T.decode_steps(batch, ctx, n) >= elapsed - 1e-12
        assert n == 1 or T.decode_steps(batch, ctx, n - 1) < elapsed
