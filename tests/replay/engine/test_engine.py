"""The engine model: FCFS prefill, prefix cache, continuous-batching decode, local check."""

from __future__ import annotations

import pytest

from config.settings import Role
from predictors.profiles import get_profile
from replay.engine.engine import DecodeSeq, Engine, PrefillJob
from replay.engine.prefix_cache import PrefixCache
from replay.engine.timing import StepTiming

T = StepTiming.from_profile(get_profile("llama3-8b-h100-tp1"), overhead_ms=0.0)


def engine(role: Role = Role.PREFILL, **kw) -> Engine:
    defaults = dict(
        cache=PrefixCache(1000) if role is not Role.DECODE else None,
        max_batch=64,
        kv_capacity_tokens=400_000,
    )
    defaults.update(kw)
    return Engine("e", role, T, **defaults)


def job(rid: str, blocks: tuple[int, ...], out: int = 10) -> PrefillJob:
    return PrefillJob(rid, blocks, len(blocks) * 16, out, 16)


def run_until_idle(e: Engine, t: float = 0.0):
    reports = []
    while (nxt := e.next_event_s()) is not None:
        reports.append((nxt, e.advance(nxt)))
    return reports


def test_fcfs_prefill_with_hand_computed_times() -> None:
    e = engine()
    e.submit_prefill(job("a", tuple(range(64))), 0.0)  # 1024 tokens
    e.submit_prefill(job("b", tuple(range(100, 132))), 0.0)  # 512 tokens
    (t1, r1), (t2, r2) = run_until_idle(e)
    assert r1.prefilled[0].request_id == "a"
    assert t1 == pytest.approx(T.step(1024, 1024 * 512, 0))
    assert t2 == pytest.approx(t1 + T.step(512, 512 * 256, 0))
    assert r2.prefilled[0].start_s == pytest.approx(t1)


def test_prefix_cache_hit_skips_recompute() -> None:
    e = engine()
    e.submit_prefill(job("a", tuple(range(64))), 0.0)
    run_until_idle(e)
    e.submit_prefill(job("b", (*range(48), 900, 901)), 10.0)  # 48 of 50 blocks cached
    ((t, r),) = run_until_idle(e)
    assert r.prefilled[0].cached_tokens == 48 * 16
    new = 2 * 16
    assert t - 10.0 == pytest.approx(T.step(new, new * (768 + new / 2), 0))


def test_lru_capacity_is_respected() -> None:
    e = engine(cache=PrefixCache(100))
    for i in range(10):
        e.submit_prefill(job(f"r{i}", tuple(range(i * 50, i * 50 + 50))), 0.0)
    run_until_idle(e)
    assert len(e.cache) == 100


def test_decode_batch_tbt_follows_the_step_model() -> None:
    e = engine(Role.DECODE)
    for i in range(4):
        assert e.submit_decode(DecodeSeq(f"s{i}", 1000, 10 * (i + 1)), 0.0) is None
    reports = run_until_idle(e)
    # Segments end when a sequence finishes: after 10, 20, 30, 40 steps.
    assert [len(r.finished) for _, r in reports] == [1, 1, 1, 1]
    t_first = reports[0][0]
    assert t_first == pytest.approx(T.decode_steps(4, 4000, 10))
    steps, tokens = zip(*[x for _, r in reports for x in r.tbt], strict=True)
    assert sum(tokens) == 10 + 20 + 30 + 40
    assert steps[0] == pytest.approx(T.step(4, 0, 4000) + T.k_s * 4 * 9 / 2)
    assert e.reserved_tokens == 0 and e.context_tokens == 0


def test_a_newcomer_joins_at_the_next_step_boundary() -> None:
    e = engine(Role.DECODE)
    e.submit_decode(DecodeSeq("long", 1000, 1000), 0.0)
    seg_end = e.next_event_s()
    step = T.step(1, 0, 1000)
    e.submit_decode(DecodeSeq("new", 500, 5), 2.5 * step)
    cut = e.next_event_s()
    assert cut < seg_end
    assert cut == pytest.approx(T.decode_steps(1, 1000, 3))  # boundary after step 3
    assert e.running["long"].joined_s == 0.0  # an idle engine takes it in at once
    assert e.joining[0].joined_s is None  # still waiting for the boundary
    e.advance(cut)
    assert e.batch == 2 and e.running["long"].generated == 3
    assert e.running["new"].joined_s == pytest.approx(cut)  # P/D's first token streams here


def test_local_check_refuses_what_breaks_the_tbt_slo() -> None:
    e = engine(Role.DECODE, decode_tbt_limit_s=0.010)
    assert e.submit_decode(DecodeSeq("a", 2000, 100), 0.0) is None
    # ~7 ms at B=1; a 100k-token context pushes the step past 10 ms.
    assert e.submit_decode(DecodeSeq("b", 100_000, 100), 0.0) == "tbt_slo"
    assert e.batch + len(e.joining) == 1


def test_kv_capacity_refusal() -> None:
    e = engine(Role.DECODE, kv_capacity_tokens=5000)
    assert e.submit_decode(DecodeSeq("a", 4000, 500), 0.0) is None
    assert e.submit_decode(DecodeSeq("b", 1000, 100), 0.0) == "kv_capacity"


def test_colocated_prefills_then_decodes_locally_in_mixed_steps() -> None:
    e = engine(Role.BOTH, chunk_tokens=512)
    e.submit_prefill(job("a", tuple(range(64)), out=20), 0.0)  # 1024 tokens, 2 chunks
    reports = run_until_idle(e)
    prefilled = [r for _, r in reports if r.prefilled]
    finished = [s for _, r in reports for s in r.finished]
    assert len(prefilled) == 1 and finished[0].generated == 19
    assert reports[0][0] == pytest.approx(T.step(512, 512 * 256, 0))


def test_drop_clears_accounting() -> None:
    e = engine(Role.DECODE)
    e.submit_decode(DecodeSeq("a", 1000, 100), 0.0)
    e.advance(e.next_event_s())  # not finished: segment ran to its end? only one seq
    e.submit_decode(DecodeSeq("b", 1000, 100), 0.0)
    assert e.drop("b") and e.drop("a") is not None
    assert e.reserved_tokens == 0


def test_step_at_a_time_mode_emits_every_step() -> None:
    e = engine(Role.DECODE, max_segment_steps=1)
    e.submit_decode(DecodeSeq("a", 1000, 5), 0.0)
    reports = run_until_idle(e)
    assert len(reports) == 5
    assert [r.tbt[0][1] for _, r in reports] == [1] * 5
    assert reports[-1][1].finished[0].generated == 5


def lora_job(rid: str, adapter: str | None, out: int, base: int) -> PrefillJob:
    j = job(rid, tuple(range(base, base + 8)), out)
    j.adapter = adapter
    return j


def test_an_adapter_without_a_free_slot_waits_for_the_running_adapter_to_leave() -> None:
    """vLLM --max-loras 1: b (adapter y) waits while a (adapter x) decodes, however idle the
    engine; c (x again) and d (no adapter) behind it are not held up (vLLM skips b, FCFS among
    the rest)."""
    e = engine(Role.BOTH, max_adapters=1)
    e.submit_prefill(lora_job("a", "x", 50, 0), 0.0)
    e.submit_prefill(lora_job("b", "y", 5, 100), 0.0)
    e.submit_prefill(lora_job("c", "x", 5, 200), 0.0)
    e.submit_prefill(lora_job("d", None, 5, 300), 0.0)
    assert e.adapters_in_use() == {"x"} and e.waiting_for_slot() == 1  # a started: b waits
    done: dict[str, float] = {}
    finished: dict[str, float] = {}
    while (t := e.next_event_s()) is not None:
        r = e.advance(t)
        done.update((p.request_id, p.end_s) for p in r.prefilled)
        finished.update((s.request_id, t) for s in r.finished)
        if "a" not in finished:
            assert e.adapters_in_use() == {"x"} and "b" not in done
    assert done["c"] < done["b"] and done["d"] < done["b"]
    assert done["b"] > finished["a"] > finished["c"]  # y got the slot when x's last one left


def test_two_slots_run_two_adapters_at_once_and_no_adapter_needs_none() -> None:
    e = engine(Role.BOTH, max_adapters=2)
    for i, adapter in enumerate(("x", "y", None)):
        e.submit_prefill(lora_job(f"r{i}", adapter, 20, i * 100), 0.0)
    reports = run_until_idle(e)
    first_finish = next(t for t, r in reports if r.finished)
    starts = [p.start_s for _, r in reports for p in r.prefilled]
    assert len(starts) == 3 and max(starts) < first_finish  # nobody waited for a slot


def test_a_pd_decode_leg_of_another_adapter_joins_when_the_slot_frees() -> None:
    e = engine(Role.DECODE, max_adapters=1)
    a, b = DecodeSeq("a", 100, 20), DecodeSeq("b", 100, 5)
    a.adapter, b.adapter = "x", "y"
    assert e.submit_decode(a, 0.0) is None and e.submit_decode(b, 0.0) is None
    assert set(e.running) == {"a"} and e.waiting_for_slot() == 1
    finished = [s.request_id for _, r in run_until_idle(e) for s in r.finished]
    assert finished == ["a", "b"] and e.reserved_tokens == 0


def test_max_adapters_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_adapters"):
        engine(max_adapters=0)
    with pytest.raises(ValueError, match="max_cached_adapters"):
        engine(max_adapters=2, max_cached_adapters=1)  # vLLM: max_cpu_loras >= max_loras


def test_an_adapter_out_of_the_host_cache_is_read_in_inside_the_step_that_runs_it() -> None:
    """vLLM --max-cpu-loras 1 with a 0.5 s load: x's first request pays it, the next x request
    does not, y pays it and evicts x, so x pays it again."""
    e = engine(Role.PREFILL, max_adapters=1, adapter_load_s=0.5, max_cached_adapters=1)
    spans = []
    for i, adapter in enumerate(("x", "x", "y", "x")):
        start = e.clock_s + 1.0
        e.submit_prefill(lora_job(f"r{i}", adapter, 1, i * 100), start)
        (done,) = [p for _, r in run_until_idle(e) for p in r.prefilled]
        spans.append(round(done.end_s - start, 4))
    step = round(T.step(128, 128 * 64, 0), 4)
    assert spans == [step + 0.5, step, step + 0.5, step + 0.5]
    assert list(e.cached_adapters) == ["x"]


def test_a_decode_segment_cut_by_a_newcomer_keeps_its_adapter_load() -> None:
    e = engine(Role.DECODE, max_adapters=2, adapter_load_s=0.25)
    a = DecodeSeq("a", 100, 50, adapter="x")
    assert e.submit_decode(a, 0.0) is None
    first = e.next_event_s()
    assert first == pytest.approx(0.25 + T.decode_steps(1, 100, 50))
    assert e.submit_decode(DecodeSeq("b", 100, 5), 0.3) is None  # cuts the segment
    cut = e.next_event_s()
    assert cut is not None and 0.3 <= cut < first
    steps = T.decode_steps_until(1, 100, 0.3 - 0.25)
    assert cut == pytest.approx(0.25 + T.decode_steps(1, 100, steps))
