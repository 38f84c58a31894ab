"""LoRA adapter affinity (routing/lora_affinity.py) on a real Conductor: an adapter's request
goes where the adapter can run at once, by the engines' adapter slots and kvgate's own
requests in flight."""

from __future__ import annotations

from dataclasses import replace

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
