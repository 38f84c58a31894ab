from dataclasses import replace

import pytest

from routing.conductor import Conductor
from routing.llamacpp_slots import InstanceSlots, SlotBook, SlotState
from routing.types import Decision
from tests.routing.fleet import fleet_settings, prompt, request

A = (1, 2, 3, 4)  # a system prompt's blocks
B = (9, 8, 7, 6)


def _slots(n: int, max_waiting: int = 1) -> InstanceSlots:
    return InstanceSlots([SlotState() for _ in range(n)], max_waiting=max_waiting)


def test_a_repeat_goes_to_the_slot_holding_its_prefix():
    inst = _slots(2)
    first = inst.choose((*A, 10), 0.0)
    inst.release(first.slot, 1.0)
    other = inst.choose((*B, 11), 2.0)
    assert other.slot != first.slot  # the LRU idle slot, not the one holding A
    again = inst.choose((*A, 12), 3.0)
    assert again.slot == first.slot
    assert again.matched_blocks == 4
    assert again.evicted == (10,)  # the old request's own tail block, held by no slot


def test_a_busy_matching_slot_is_waited_for_rather_than_overwriting_another_prefix():
    inst = _slots(2)
    a = inst.choose((*A, 10), 0.0)
    b = inst.choose((*B, 11), 0.0)
    inst.release(b.slot, 1.0)  # B's slot is idle, A's is still running
    second_a = inst.choose((*A, 12), 2.0)
    assert second_a.slot == a.slot  # llama-server defers it; B stays cached
    assert inst.slots[b.slot].blocks == (*B, 11)


def test_spills_to_an_idle_slot_once_the_queue_is_full():
    inst = _slots(2, max_waiting=1)
    a = inst.choose(A, 0.0)
    assert inst.choose(A, 0.0).slot == a.slot  # one running + one waiting
    spilled = inst.choose(A, 0.0)
    assert spilled.slot != a.slot
    assert spilled.matched_blocks == 0


def test_eviction_reports_only_blocks_no_slot_still_holds():
    inst = _slots(2)
    x = inst.choose((*A, 5), 0.0)
    inst.release(x.slot, 1.0)
    y = inst.choose((*A, 60), 1.0)  # same slot (prefix A), tail 5 dropped
    assert y.slot == x.slot and y.evicted == (5,)
    inst.release(y.slot, 2.0)
    inst.choose((*B, 70), 3.0)  # the other (empty) slot
    z = inst.choose((99,), 4.0)  # no match; A's slot is not busy but B's is: A's is replaced
    assert z.slot == x.slot
    assert set(z.evicted) == {*A, 60}


def test_no_match_and_all_busy_goes_to_the_shortest_queue():
    inst = _slots(2, max_waiting=5)
    a = inst.choose(A, 0.0)
    b = inst.choose(B, 0.0)
    assert inst.choose(A, 0.0).slot == a.slot  # two on A's slot now
    c = inst.choose((42,), 0.0)  # no match, no idle slot
    assert c.slot == b.slot
    assert inst.slots[b.slot].active == 2


def test_book_pins_per_request_and_releases_once():
    book = SlotBook()
    assert book.assign("r0", "llama-0", A, 0.0) is None  # slots not known yet
    book.set_slots("llama-0", 2)
    c = book.assign("r1", "llama-0", A, 0.0)
    assert c is not None and book.held == 1
    assert book.assign("r1", "llama-0", A, 0.0) is None  # already pinned
    book.release("r1", 1.0)
    book.release("r1", 1.0)
    assert book.held == 0
    assert book.instances["llama-0"].slots[c.slot].active == 0


def test_a_new_slot_count_starts_afresh_and_forget_drops_the_instance():
    book = SlotBook()
    book.set_slots("i", 2)
    book.assign("r", "i", A, 0.0)
    book.set_slots("i", 2)  # same layout: state kept
    assert book.instances["i"].slots[0].blocks or book.instances["i"].slots[1].blocks
    book.set_slots("i", 4)
    assert len(book.instances["i"].slots) == 4
    assert all(not s.blocks for s in book.instances["i"].slots)
    book.release("r", 1.0)  # the old pin is harmless
    book.forget("i")
    assert "i" not in book.instances


# ---- what a placement would destroy: shared prefixes an idle slot loses ----


def _book_with_shared_b(instance: str = "i") -> SlotBook:
    """``instance``'s least recently used idle slot holds B, which served two requests; its
    other slot holds U, which served one."""
    book = SlotBook()
    book.set_slots(instance, 2)
    for rid, blocks, t in (("b1", (*B, 20), 0.0), ("b2", (*B, 21), 2.0), ("u", (50, 51), 4.0)):
        book.assign(rid, instance, blocks, t)
        book.release(rid, t + 1.0)
    return book


def test_a_prefix_reused_by_a_second_request_is_shared_and_its_slot_would_lose_it():
    book = _book_with_shared_b()
    slots = book.instances["i"].slots
    assert [s.blocks[:4] for s in slots] == [B, (50, 51)]
    assert [s.shared for s in slots] == [4, 0]  # B's blocks, not the tail of its last request
    assert book.shared_evictions("i", (77, 78)) == 4
    # A request for B itself reuses the slot: nothing is lost.
    assert book.shared_evictions("i", (*B, 22)) == 0


def test_nothing_is_lost_where_no_prefix_was_shared_or_another_slot_keeps_it():
    book = SlotBook()
    book.set_slots("i", 2)
    book.assign("a", "i", (1, 2), 0.0)
    book.release("a", 1.0)
    assert book.shared_evictions("i", (7, 8)) == 0  # A served one request
    assert book.shared_evictions("unknown", (7, 8)) == 0
    book = _book_with_shared_b()
    rids = [f"b{k}" for k in range(3, 8)]
    for k, rid in enumerate(rids):  # pinned to B's slot until 3 wait, then B spills over
        book.assign(rid, "i", (*B, 30 + k), 6.0)
    for rid in rids:
        book.release(rid, 7.0)
    assert all(s.blocks[:4] == B for s in book.instances["i"].slots)
    assert book.shared_evictions("i", (77,)) == 0  # the other copy of B stays


def test_a_prefix_held_in_a_slot_file_costs_nothing_to_overwrite():
    book = _book_with_shared_b()
    assert book.shared_evictions("i", (77, 78)) == 4
    book.stored.update(B)  # gateway/slot_files.py saved it: a restore brings it back
    assert book.shared_evictions("i", (77, 78)) == 0


def test_release_reports_the_slot_it_freed():
    book = SlotBook()
    book.set_slots("i", 2)
    choice = book.assign("r", "i", (*A, 5), 0.0)
    assert choice is not None
    released = book.release("r", 1.0)
    assert released is not None
    instance, slot, state = released
    assert (instance, slot, state.blocks, state.active) == ("i", choice.slot, (*A, 5), 0)
    assert book.release("r", 2.0) is None


def test_a_prefix_found_on_another_instance_counts_as_shared():
    book = SlotBook()
    book.set_slots("i", 1)
    book.set_slots("j", 1)
    book.assign("a", "i", (*A, 10), 0.0)
    book.release("a", 1.0)
    book.assign("b", "j", (*A, 11), 2.0)  # A's second request, on another engine
    book.release("b", 3.0)
    assert book.instances["i"].slots[0].shared == 4
    assert book.instances["j"].slots[0].shared == 4
    assert [book.shared_evictions(i, (77,)) for i in "ij"] == [4, 4]


def _slot_conductor(weight: float) -> Conductor:
    """Two idle colocated llama.cpp instances: c0's LRU idle slot holds the shared B."""
    s = fleet_settings(prefill=0, decode=0, colocated=2)
    c = Conductor(replace(s, routing=replace(s.routing, llamacpp_evict_weight=weight)))
    c.slots = _book_with_shared_b("c0")
    c.slots.set_slots("c1", 2)
    return c


def test_placement_charges_the_recompute_of_the_prefix_a_slot_would_lose():
    blind = _slot_conductor(0.0).schedule(request("r", prompt(3, 40)), 10.0)
    charged = _slot_conductor(1.0).schedule(request("r", prompt(3, 40)), 10.0)
    assert isinstance(blind, Decision) and isinstance(charged, Decision)
    assert blind.prefill == "c0"  # the tie goes to the first instance, B is overwritten
    assert charged.prefill == "c1"  # an empty slot costs nothing later
    # The charge ranks; it is no part of the TTFT promised.
    assert charged.predicted_ttft_s == pytest.approx(blind.predicted_ttft_s)


def test_a_repeat_of_the_held_prefix_is_not_charged():
    d = _slot_conductor(1.0).schedule(request("r", (*B, 40)), 10.0)
    assert isinstance(d, Decision) and d.prefill == "c0"
