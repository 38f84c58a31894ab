"""Synthetic workload generation (``replay.workload.synthetic``)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from replay.workload.synthetic import (
    LengthDist,
    SyntheticSpec,
    chat_spec,
    fixed,
    generate,
    lognormal,
    uniform,
    write_mooncake,
)
from replay.workload.traces import TraceRequest, blocks_for, load_mooncake, trace_summary


def gaps(reqs: list[TraceRequest]) -> np.ndarray:
    return np.diff([r.arrival_s for r in reqs])


def assert_chained(reqs: list[TraceRequest]) -> None:
    """Mooncake format invariants: one id per 512-token block, each id at one position."""
    position: dict[int, int] = {}
    for r in reqs:
        assert len(r.hash_ids) == blocks_for(r.input_length)
        for pos, h in enumerate(r.hash_ids):
            assert position.setdefault(h, pos) == pos


def test_same_seed_same_trace_other_seed_differs() -> None:
    spec = SyntheticSpec(
        requests=500, rate_rps=3.0, families=5, family_fraction=0.5, followup_prob=0.3, seed=11
    )
    a = generate(spec)
    assert a == generate(spec)
    b = generate(replace(spec, seed=12))
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [r.index for r in a] == list(range(500))
    assert a[0].arrival_s == 0.0
    assert_chained(a)


def test_poisson_rate_and_cv() -> None:
    reqs = generate(SyntheticSpec(requests=20_000, rate_rps=5.0, seed=1))
    g = gaps(reqs)
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)


def test_gamma_arrivals_are_burstier() -> None:
    reqs = generate(SyntheticSpec(requests=20_000, rate_rps=5.0, arrival="gamma", cv=2.0))
    g = gaps(reqs)
    assert 1 / g.mean() == pytest.approx(5.0, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(2.0, rel=0.1)


def test_duration_bound() -> None:
    reqs = generate(SyntheticSpec(requests=None, duration_s=200.0, rate_rps=10.0, seed=3))
    assert reqs[-1].arrival_s < 200.0
    assert len(reqs) == pytest.approx(2000, rel=0.1)
    capped = generate(SyntheticSpec(requests=50, duration_s=200.0, rate_rps=10.0, seed=3))
    assert capped == reqs[:50]  # the request cap wins; a shorter run is a prefix


def test_families_share_prefixes_with_zipf_popularity() -> None:
    spec = SyntheticSpec(
        requests=3000,
        families=8,
        family_zipf=1.2,
        family_prefix_blocks=3,
        family_fraction=0.6,
        input_len=lognormal(2000, 0.5),
        seed=5,
    )
    reqs = generate(spec)
    assert_chained(reqs)
    heads: dict[tuple[int, ...], int] = {}
    for r in reqs:
        heads[r.hash_ids[:3]] = heads.get(r.hash_ids[:3], 0) + 1
    shared = sorted((n for n in heads.values() if n > 1), reverse=True)
    assert len(shared) == 8  # one 3-block prefix per family, nothing else repeats
    assert sum(shared) == pytest.approx(0.6 * 3000, rel=0.05)
    assert shared[0] > 2 * shared[-1]  # Zipf: the top family is far more popular
    # Members carry the whole system prompt plus at least one token.
    members = [r for r in reqs if heads[r.hash_ids[:3]] > 1]
    assert min(r.input_length for r in members) > 3 * 512


def test_no_structure_means_no_reuse() -> None:
    reqs = generate(SyntheticSpec(requests=1000))
    assert trace_summary(reqs)["blocks_seen_before"] == 0.0


def test_followups_repeat_the_previous_prompt_full_blocks() -> None:
    spec = SyntheticSpec(
        requests=40,
        followup_prob=1.0,
        max_conversations=1,
        input_len=fixed(700),
        output_len=fixed(100),
        max_context_tokens=6000,
    )
    reqs = generate(spec)
    assert_chained(reqs)
    # One conversation grows by 700 + 100 tokens a turn until it would pass 6000 tokens,
    # then a fresh one starts.
    assert [r.input_length for r in reqs[:8]] == [700, 1500, 2300, 3100, 3900, 4700, 5500, 700]
    for prev, cur in itertools.pairwise(reqs[:7]):
        full = prev.input_length // 512
        assert cur.hash_ids[:full] == prev.hash_ids[:full]
        # The previous partial block now holds other tokens: it gets a new id.
        assert cur.hash_ids[full] not in prev.hash_ids
    assert not set(reqs[7].hash_ids) & {h for r in reqs[:7] for h in r.hash_ids}


def test_write_and_load_round_trip(tmp_path: Path) -> None:
    reqs = generate(chat_spec(requests=300, followup_prob=0.3, seed=2))
    path = tmp_path / "syn.jsonl"
    write_mooncake(reqs, path)
    back = load_mooncake(path)
    assert len(back) == len(reqs)
    for a, b in zip(reqs, back, strict=True):
        assert b.arrival_s == pytest.approx(a.arrival_s, abs=1e-6)
        assert (b.index, b.input_length, b.output_length, b.hash_ids) == (
            a.index,
            a.input_length,
            a.output_length,
            a.hash_ids,
        )


def test_write_refuses_requests_without_block_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hash ids"):
        write_mooncake([TraceRequest(0, 0.0, 1000, 5, ())], tmp_path / "x.jsonl")


def test_chat_preset_lengths() -> None:
    reqs = generate(chat_spec(requests=5000, rate_rps=8.0))
    s = trace_summary(reqs)
    assert 900 <= s["mean_input_tokens"] <= 1150  # type: ignore[operator]
    assert 270 <= s["mean_output_tokens"] <= 330  # type: ignore[operator]
    assert s["rate_rps"] == pytest.approx(8.0, rel=0.05)
    assert 0.0 < s["blocks_seen_before"] < 0.5  # type: ignore[operator]


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    assert set(fixed(300).sample(rng, 50)) == {300}
    u = uniform(10, 20).sample(rng, 2000)
    assert u.min() == 10 and u.max() == 20
    ln = lognormal(1000, 0.5).sample(rng, 50_000)
    assert ln.mean() == pytest.approx(1000, rel=0.02)
    clipped = lognormal(1000, 1.0, low=500, high=1500).sample(rng, 1000)
    assert clipped.min() >= 500 and clipped.max() <= 1500


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests": None}, "give requests or duration_s"),
        ({"rate_rps": 0.0}, "rate_rps > 0"),
        ({"arrival": "uniform"}, "arrival 'uniform' unknown; known: poisson, gamma"),
        ({"family_fraction": 0.5}, "needs families >= 1"),
        ({"followup_prob": 1.5}, r"followup_prob must be in \[0, 1\]"),
        ({"duration_s": -1.0}, "duration_s must be > 0"),
    ],
)
def test_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticSpec(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown; known: fixed, uniform, lognormal"):
        LengthDist("pareto")
