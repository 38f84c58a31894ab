"""routing/capacity.py on hand-computed cases (the arithmetic is written out in each test)."""

from __future__ import annotations

import math

import pytest

from config.settings import Role
from predictors.decode import DecodeStepModel
from predictors.prefill import AnalyticPrefill
from routing.capacity import (
    DemandSample,
    DemandWindow,
    PoolModel,
    decode_batch_limit,
    instances_needed,
    prefill_utilisation_target,
    wait_exceeds,
)

# 1 ms per new token, nothing else: a prompt of 1000 new tokens takes exactly 1 s.
PREFILL = AnalyticPrefill(fixed_s=0.0, per_token_s=0.001, knee_tokens=0, attn_s=0.0)
# step(B) = 10 ms + B * (1 ms + 0.001 ms * context per sequence)
DECODE = DecodeStepModel(a_ms=10.0, b_ms=1.0, k_ms=0.001)

# S = 1 s always: r = E[S^2] / (2 E[S]) = 0.5. TTFT SLO 3 s: budget b = 2 s, so the share
# missing is u * exp(-2 (1 - u) / 0.5) = u * exp(-4 (1 - u)); at u = 0.5 that is 0.5 e^-2.
HALF = 0.5 * math.exp(-2.0)
THIRD = (1 / 3) * math.exp(-4.0 * 2 / 3)  # the share at u = 1/3


def _pool(name: str, role: Role, kv: int = 22_000, instances: int = 2) -> PoolModel:
    return PoolModel(name, role, instances, PREFILL, DECODE, kv, 256)


def _window(n: int, *, prompt: int = 1000, cached: int = 0, output: int = 200) -> DemandWindow:
    w = DemandWindow(10.0)
    w.start(0.0)
    for i in range(n):  # n requests spread over the 10 s window
        w.add(DemandSample(i * 10.0 / n, prompt, cached, output, "p", "d"))
    return w


def _need(w: DemandWindow, pools: list[PoolModel], share: float = HALF, tbt: float = 0.1):
    return instances_needed(w, pools, 10.0, ttft_slo_s=3.0, tbt_slo_s=tbt, ttft_miss_share=share)


def test_wait_tail_is_the_mm1_formula() -> None:
    # M/M/1 with E[S] = 1 (r = 1), u = 0.5: P(W > 2) = 0.5 e^{-1}
    assert wait_exceeds(0.5, 2.0, 1.0) == pytest.approx(0.5 * math.exp(-1.0))
    assert wait_exceeds(0.5, 0.0, 1.0) == 0.5  # waits at all with probability u


def test_prefill_utilisation_target_from_the_wait_tail() -> None:
    ones = [1.0] * 10
    assert prefill_utilisation_target(ones, 3.0, HALF, 0.9) == (pytest.approx(0.5), True)
    assert prefill_utilisation_target(ones, 3.0, THIRD, 0.9)[0] == pytest.approx(1 / 3)
    # a lenient share is capped: at u = 0.9 the share is 0.9 e^-0.4 = 0.60 < 0.7
    assert prefill_utilisation_target(ones, 3.0, 0.7, 0.9) == (0.9, True)
    # every prefill alone is longer than the SLO: unreachable, the cap is used
    assert prefill_utilisation_target(ones, 0.5, 0.05, 0.9) == (0.9, False)
    # a 5 s prompt cannot meet a 3 s SLO: left out of the share, but it still loads the queue
    # (r = (9 + 25) / (2 * 14) = 34 / 28)
    mixed = [1.0] * 9 + [5.0]
    u, ok = prefill_utilisation_target(mixed, 3.0, 0.05, 0.9)
    assert ok and wait_exceeds(u, 2.0, 34 / 28) == pytest.approx(0.05)


def test_prefill_pool_count() -> None:
    # 10 requests x 1 s in 10 s: R = 1 prefill-second per second.
    need = _need(_window(10), [_pool("p", Role.PREFILL)], share=0.7)["p"]
    assert need.prefill_load_s_per_s == pytest.approx(1.0)
    assert need.prefill_utilisation_target == 0.9
    assert need.load_instances == pytest.approx(1 / 0.9)
    assert need.needed == 2
    # u* = 0.5 -> exactly 2.0 instances (not 3); u* = 1/3 -> 3.0 -> 3.
    assert _need(_window(10), [_pool("p", Role.PREFILL)], share=HALF)["p"].needed == 2
    assert _need(_window(10), [_pool("p", Role.PREFILL)], share=THIRD)["p"].needed == 3


def test_cached_tokens_are_not_prefilled_again() -> None:
    # 1500-token prompts with 500 cached: 1000 new tokens, still 1 s each -> same as above.
    w = _window(10, prompt=1500, cached=500)
    assert _need(w, [_pool("p", Role.PREFILL)])["p"].prefill_load_s_per_s == pytest.approx(1.0)
    w = _window(10, prompt=1500, cached=1000)  # 500 new tokens: 0.5 s each
    assert _need(w, [_pool("p", Role.PREFILL)])["p"].prefill_load_s_per_s == pytest.approx(0.5)


def test_decode_batch_limit_by_kv_tbt_and_max_batch() -> None:
    # context c = 1000 + 200/2 = 1100: per sequence 1 + 1.1 = 2.1 ms; TBT 100 ms leaves 90 ms
    # -> 42 by TBT; KV 22000 / 1100 = 20 by KV.
    assert decode_batch_limit(DECODE, 0.1, 1100.0, 22_000, 256) == (20, True)
    assert decode_batch_limit(DECODE, 0.1, 1100.0, 10**6, 256) == (42, True)
    assert decode_batch_limit(DECODE, 0.1, 1100.0, 10**6, 8) == (8, True)
    # 5 ms SLO is below the 10 ms fixed step: unreachable, batch 1.
    assert decode_batch_limit(DECODE, 0.005, 1100.0, 10**6, 256) == (1, False)


def test_decode_pool_count() -> None:
    # 40 requests x 200 tokens in 10 s: D = 800 tokens/s.
    # KV-bound B* = 20: step = 10 + 20 * 2.1 = 52 ms -> 384.6 tok/s -> 2.08 -> 3 instances.
    need = _need(_window(40), [_pool("d", Role.DECODE)])["d"]
    assert need.decode_tokens_per_s == pytest.approx(800.0)
    assert need.decode_batch_limit == 20
    assert need.decode_tokens_per_s_per_instance == pytest.approx(20 / 0.052)
    assert need.needed == 3
    # TBT-bound B* = 42: step = 10 + 42 * 2.1 = 98.2 ms -> 427.7 tok/s -> 1.87 -> 2.
    assert _need(_window(40), [_pool("d", Role.DECODE, kv=10**6)])["d"].needed == 2


def test_colocated_pool_adds_prefill_and_decode() -> None:
    w = DemandWindow(10.0)
    w.start(0.0)
    for i in range(40):
        w.add(DemandSample(i * 0.25, 1000, 0, 200, "c", "c"))
    need = _need(w, [_pool("c", Role.BOTH)])["c"]
    # prefill: R = 40 s / 10 s = 4 -> 4 / 0.5 = 8; decode: 800 / 384.6 = 2.08 -> 10.08 -> 11
    assert need.load_instances == pytest.approx(8.0 + 800 * 0.052 / 20)
    assert need.needed == 11


def test_refusals_count_as_the_mean_admitted_request() -> None:
    w = _window(10)
    w.add_refused(5.0, 10)  # as many turned away as admitted: twice the demand
    need = _need(w, [_pool("p", Role.PREFILL)])["p"]
    assert need.prefill_load_s_per_s == pytest.approx(2.0)
    assert need.needed == 4  # 2 / 0.5
    only_refused = DemandWindow(10.0)
    only_refused.add_refused(1.0, 5)
    assert _need(only_refused, [_pool("p", Role.PREFILL, instances=2)])["p"].needed == 3


def test_window_forgets_old_demand_and_a_young_window_uses_its_age() -> None:
    w = _window(10)  # samples at 0, 1, ..., 9 s
    need = instances_needed(w, [_pool("p", Role.PREFILL)], 15.0, ttft_slo_s=3.0, tbt_slo_s=0.1)
    # at 15 s the window [5, 15] keeps 5 samples: R = 5 / 10 = 0.5
    assert need["p"].prefill_load_s_per_s == pytest.approx(0.5)
    young = DemandWindow(10.0)
    young.start(0.0)
    young.add(DemandSample(1.0, 1000, 0, 1, "p", "d"))
    young.add(DemandSample(2.0, 1000, 0, 1, "p", "d"))
    got = instances_needed(young, [_pool("p", Role.PREFILL)], 4.0, ttft_slo_s=3.0, tbt_slo_s=0.1)
    assert got["p"].prefill_load_s_per_s == pytest.approx(2 / 4)  # 2 s of work in 4 s


def test_no_demand_needs_nothing_and_bad_input_is_refused() -> None:
    empty = DemandWindow(10.0)
    need = _need(empty, [_pool("p", Role.PREFILL), _pool("d", Role.DECODE)])
    assert need["p"].needed == 0 and need["d"].needed == 0
    with pytest.raises(ValueError, match="window_s"):
        DemandWindow(0.0)
    with pytest.raises(ValueError, match="count"):
        empty.add_refused(0.0, -1)
