from backends.llamacpp_slots import InstanceSlots, SlotBook, SlotState

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
