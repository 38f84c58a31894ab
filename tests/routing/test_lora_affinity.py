"""LoRA adapter affinity (routing/lora_affinity.py) on a real Conductor: an adapter's request
goes where the adapter can run at once, by the engines' adapter slots and kvgate's own
requests in flight."""

from __future__ import annotations

from dataclasses import replace

import pytest

from routing.conductor import Conductor
from routing.lora_affinity import EngineAdapters
from routing.types import Decision
from tests.routing.fleet import busy, fleet_settings, hold, prompt, request


def _conductor(affinity: bool = True) -> Conductor:
    settings = fleet_settings(prefill=0, decode=0, colocated=2)
    c = Conductor(replace(settings, routing=replace(settings.routing, lora_affinity=affinity)))
    for iid in ("c0", "c1"):
        c.lora.engine_state(iid, EngineAdapters(max_loras=1))
    return c


def _place(c: Conductor, rid: str, lora: str | None, family: int, now: float = 0.0) -> Decision:
    req = request(rid, prompt(family, 8), lora=lora, now=now)
    d = c.schedule(req, now)
    assert isinstance(d, Decision), d
    c.dispatched(d, req, now)
    return d


def test_another_adapter_goes_to_the_instance_with_a_free_slot_even_if_it_is_busier() -> None:
    c = _conductor()
    a = _place(c, "a1", "sql", 1)
    busy(c, "c0" if a.prefill == "c1" else "c1", 2.0)  # the other instance: 2 s of queue
    b = _place(c, "b1", "chat", 2)
    assert b.prefill != a.prefill  # its slot is taken by "sql" there
    again = _place(c, "a2", "sql", 3)
    assert again.prefill == a.prefill  # active there; the other runs "chat"


def test_without_affinity_the_queue_alone_decides() -> None:
    c = _conductor(affinity=False)
    a = _place(c, "a1", "sql", 1)
    busy(c, "c0" if a.prefill == "c1" else "c1", 2.0)
    assert _place(c, "b1", "chat", 2).prefill == a.prefill  # the shorter queue


def test_the_engines_running_adapters_count_and_a_full_fleet_falls_back_to_placement() -> None:
    c = _conductor()
    c.lora.engine_state("c0", EngineAdapters(1, frozenset({"sql"})))  # a direct client's
    c.lora.engine_state("c1", EngineAdapters(1, frozenset({"chat"})))
    hold(c, "c1", prompt(4, 8))  # where its prefix is cached
    assert _place(c, "x1", "sql", 4).prefill == "c0"  # runs there now: beats the cache
    assert _place(c, "x2", "code", 4).prefill == "c1"  # no slot anywhere: the cache decides
    assert _place(c, "x3", None, 4).prefill == "c1"  # the base model: no adapter to wait for


def test_a_finished_request_frees_its_slot_and_unknown_slots_count_as_free() -> None:
    c = _conductor()
    busy(c, "c1", 2.0)
    assert _place(c, "a1", "sql", 1).prefill == "c0"
    assert _place(c, "b1", "chat", 2).prefill == "c1"  # c0's one slot runs "sql"
    c.finished("a1", 1.0)
    assert _place(c, "b2", "chat", 3, now=1.0).prefill == "c0"  # free again, and less busy
    c.lora.engine_state("c0", None)  # its LoRA metrics gone: nothing to wait for there
    assert _place(c, "b3", "code", 4, now=1.0).prefill == "c0"


def test_a_request_placed_again_counts_once_where_it_is_now() -> None:
    c = _conductor()
    first = _place(c, "a1", "sql", 1)
    elsewhere = "c1" if first.prefill == "c0" else "c0"
    moved = replace(first, prefill=elsewhere, decode=elsewhere)
    c.lora.placed("sql", moved)  # as a fallback's re-dispatch or a decode move does
    c.lora.engine_state(first.prefill, EngineAdapters(1))
    assert _place(c, "b1", "chat", 2).prefill == first.prefill  # its old slot is free
    pool = [c.instances["c0"], c.instances["c1"]]
    assert c.lora.candidates("code", pool) == pool  # no free slot: the whole pool
    c.lora.left("a1")
    c.lora.left("a1")  # twice: nothing more to take away
    assert c.lora.candidates("code", pool) == [c.instances[elsewhere]]


def test_own_requests_of_more_adapters_than_slots_mean_one_of_them_waits_there() -> None:
    """vLLM lists only adapters whose requests have run: kvgate's own "chat" request on c0,
    which runs "sql", waits there unlisted. More "chat" does not count on c0, and neither does
    more "sql" while another instance can take it: c0 drains, and "chat" gets the slot after
    the "sql" requests already there (not after every "sql" request yet to come)."""
    c = _conductor(affinity=False)  # the first two land where the queue says: both on c0
    busy(c, "c1", 2.0)
    assert _place(c, "a1", "sql", 1).prefill == "c0"
    assert _place(c, "b1", "chat", 2).prefill == "c0"
    c.lora.engine_state("c0", EngineAdapters(1, frozenset({"sql"})))
    pool = [c.instances["c0"], c.instances["c1"]]
    assert c.lora.candidates("chat", pool) == [c.instances["c1"]]
    assert c.lora.candidates("sql", pool) == [c.instances["c1"]]  # a free slot: not on c0
    c.lora.engine_state("c1", EngineAdapters(1, frozenset({"code"})))
    assert c.lora.candidates("sql", pool) == pool  # nowhere at once: placement decides
    c.lora.left("b1")  # the waiting "chat" request is gone: c0 runs "sql" for all
    assert c.lora.candidates("sql", pool) == [c.instances["c0"]]


def _loads_conductor(load_s: float | None) -> Conductor:
    settings = fleet_settings(prefill=0, decode=0, colocated=2)
    routing = replace(settings.routing, lora_load_s=load_s)
    c = Conductor(replace(settings, routing=routing))
    for iid in ("c0", "c1"):
        c.lora.engine_state(iid, EngineAdapters(max_loras=1))
    return c


@pytest.mark.parametrize(("wait_s", "where"), [(0.5, "c1"), (2.0, "c0")])
def test_a_load_from_disk_is_weighed_against_the_wait_where_the_adapter_is_held(
    wait_s: float, where: str
) -> None:
    """Both instances have a free slot; "sql" ran on c1 last, so only c1 holds it in host
    memory. With a 1 s load, a 0.5 s queue on c1 beats loading on the idle c0; 2 s does not."""
    c = _loads_conductor(load_s=1.0)
    busy(c, "c0", 5.0)
    first = _place(c, "a1", "sql", 1)
    assert first.prefill == "c1" and first.adapter_load_s == 1.0  # never ran: cold
    c.finished("a1", 0.0)
    c.instances["c0"].finish_prefill("filler-c0-5.0", 0.0)
    busy(c, "c1", wait_s)
    again = _place(c, "a2", "sql", 2)
    assert again.prefill == where
    assert again.adapter_load_s == (None if where == "c1" else 1.0)
    if where == "c0":  # charged: the load is booked as the engine's work
        assert again.predicted_load_s == 1.0 and again.predicted_ttft_s > 1.0


def test_the_load_time_is_learned_from_first_tokens_and_zero_turns_it_off() -> None:
    c = _loads_conductor(load_s=None)
    cold = _place(c, "a1", "sql", 1)
    assert cold.adapter_load_s == 0.0  # cold, nothing learned yet: marked, not charged
    c.first_token("a1", cold.predicted_ttft_s + 0.8)  # the load: 0.8 s late
    assert c.lora.loads.load_s() == pytest.approx(0.8)
    other = "c0" if cold.prefill == "c1" else "c1"
    assert c.lora.load_costs("sql", [c.instances["c0"], c.instances["c1"]]) == {
        other: pytest.approx(0.8)
    }
    off = _loads_conductor(load_s=0.0)
    assert _place(off, "a1", "sql", 1).adapter_load_s == 0.0
    off.first_token("a1", 5.0)
    assert off.lora.loads.load_s() == 0.0


def test_the_adapters_an_engine_runs_are_held_and_a_base_model_request_is_never_charged() -> None:
    c = _loads_conductor(load_s=1.0)
    c.lora.engine_state("c0", EngineAdapters(2, frozenset({"sql"})))  # a direct client's
    pool = [c.instances["c0"], c.instances["c1"]]
    assert c.lora.load_costs("sql", pool) == {"c1": 1.0}
    c.lora.engine_state("c1", None)  # no LoRA metrics: no adapter to load there
    assert c.lora.load_costs("sql", pool) == {}
    assert _place(c, "x1", None, 3).adapter_load_s is None


def test_a_first_token_after_a_queue_or_a_slot_wait_teaches_no_load() -> None:
    c = _loads_conductor(load_s=None)
    busy(c, "c0", 1.0)
    busy(c, "c1", 1.0)
    queued = _place(c, "a1", "sql", 1)  # behind a queue: its lateness may be the queue's
    c.first_token("a1", queued.predicted_ttft_s + 3.0)
    assert c.lora.loads.as_dict()["cold_samples"] == 0
    c2 = _loads_conductor(load_s=None)
    c2.lora.engine_state("c0", EngineAdapters(1, frozenset({"chat"})))
    c2.lora.engine_state("c1", EngineAdapters(1, frozenset({"code"})))
    waits = _place(c2, "b1", "sql", 2)  # no free slot anywhere: it waits for one
    c2.first_token("b1", waits.predicted_ttft_s + 3.0)
    assert c2.lora.loads.as_dict()["cold_samples"] == 0
    other = "code" if waits.prefill == "c0" else "chat"  # where "sql" does not wait
    idle = _place(c2, "b2", other, 3)  # runs at once where it runs: a resident sample
    c2.first_token("b2", idle.predicted_ttft_s + 0.1)
    assert c2.lora.loads.as_dict()["resident_samples"] == 1


def test_a_load_saved_where_another_adapter_waits_is_not_counted() -> None:
    """c0 runs "sql" with a "chat" request waiting for its one slot: "sql" is held in memory
    there, but a load saved on c0 would be paid by "chat"'s longer wait, so c0 is charged the
    load as c1 (where "code" runs) is, and the queues decide."""
    c = _loads_conductor(load_s=1.0)
    c.lora.engine_state("c0", EngineAdapters(1, frozenset({"sql"})))
    c.lora.engine_state("c1", EngineAdapters(1, frozenset({"code"})))
    pool = [c.instances["c0"], c.instances["c1"]]
    assert c.lora.load_costs("sql", pool) == {"c1": 1.0}
    c.lora.placed("chat", _decision_on("b1", "c0"))
    assert c.lora.load_costs("sql", pool) == {"c0": 1.0, "c1": 1.0}
    c.lora.left("b1")
    assert c.lora.load_costs("sql", pool) == {"c1": 1.0}


def _decision_on(rid: str, instance: str) -> Decision:
    c = _conductor()
    d = _place(c, rid, None, 9)
    return replace(d, prefill=instance, decode=instance)
