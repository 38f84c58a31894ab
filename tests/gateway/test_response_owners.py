"""The book of which instance made each Responses API answer (gateway/response_owners.py)."""

from __future__ import annotations

from gateway.response_owners import ResponseOwners


def test_owners_are_bounded_and_the_newest_kept() -> None:
    owners = ResponseOwners(limit=2)
    for i in range(3):
        owners.remember(f"r{i}", f"i{i}")
    assert len(owners) == 2 and owners.owner("r0") is None and owners.owner("r2") == "i2"


def test_only_a_shared_book_keeps_what_it_learns_itself_for_the_peers() -> None:
    alone = ResponseOwners()
    alone.remember("r1", "a")
    assert alone.take_fresh() == []  # no replicas: nothing is kept for them
    shared = ResponseOwners(limit=3, shared=True)
    shared.remember("r1", "a")
    shared.remember("r2", "b")
    assert shared.take_fresh() == [("r1", "a"), ("r2", "b")] and shared.take_fresh() == []
    for i in range(5):  # nobody takes them: only the newest ``limit`` wait
        shared.remember(f"s{i}", "a")
    assert [r for r, _ in shared.take_fresh()] == ["s2", "s3", "s4"]


def test_learned_owners_count_once_and_are_not_sent_on() -> None:
    book = ResponseOwners(limit=10, shared=True)
    assert book.learn([("r1", "a"), ("r2", "b")]) == 2
    assert book.learn([("r1", "a"), ("r2", "c")]) == 1  # a repeat is not new; a change is
    assert book.owner("r2") == "c" and book.take_fresh() == []  # a peer's, not this replica's
