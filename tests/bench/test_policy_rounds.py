"""bench.policy_rounds: the alternating round order and the ratios taken within each round."""

from __future__ import annotations

from bench.policy_rounds import ratios, round_orders


def test_rounds_alternate_the_order_and_ratios_are_taken_within_each_round() -> None:
    assert round_orders(["a", "b"], 3) == [["a", "b"], ["b", "a"], ["a", "b"]]
    keys = ("round", "policy", "ttft_mean_s", "ttft_p90_s", "engine_hit_ratio")
    rows = [
        (0, "kc", 0.2, 0.5, 0.9),
        (0, "rr", 0.4, 1.0, 0.45),
        (1, "rr", 0.5, 1.0, 0.5),
        (1, "kc", 0.4, 0.9, 0.9),
        (2, "kc", 0.3, None, 0.8),
        (2, "rr", 0.5, 1.0, 0.4),
    ]
    runs = [dict(zip(keys, row, strict=True)) for row in rows]
    out = ratios(runs, "rr")
    assert set(out) == {"kc"}  # the reference is not compared with itself
    assert out["kc"]["ttft_mean_s"] == {"per_round": [0.5, 0.8, 0.6], "median": 0.6}
    assert out["kc"]["ttft_p90_s"]["per_round"] == [0.5, 0.9]  # a missing value is skipped
    assert out["kc"]["engine_hit_ratio"]["median"] == 2.0
