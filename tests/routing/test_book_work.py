"""routing/book_work.py: the decode work kept in order, and what a sequence is still expected
to produce."""

from __future__ import annotations

import pytest

from routing.book_work import DecodeBook, DecodeWork


def _work(rid: str, output: int = 100, generated: int = 0) -> DecodeWork:
    return DecodeWork(
        rid, prompt_tokens=1000, predicted_output=output, est_arrival_s=0.0, generated=generated
    )


def test_the_book_keeps_work_in_key_then_id_order() -> None:
    book = DecodeBook()
    a, b, c = _work("a"), _work("b"), _work("c")
    book.add(5.0, c)
    book.add(2.0, b)
    book.add(5.0, a)  # same key: by request id
    assert [w.request_id for w in book.up_to(5.0)] == ["b", "a", "c"]
    assert [w.request_id for w in book.up_to(4.9)] == ["b"]
    assert book.first() is b and len(book) == 3
    assert [w.request_id for w in book] == ["b", "a", "c"]
    book.remove(5.0, a)
    assert [w.request_id for w in book.up_to(10.0)] == ["b", "c"]
    with pytest.raises(KeyError):
        book.remove(5.0, a)  # no longer in the book
    with pytest.raises(KeyError):
        book.remove(2.0, _work("b"))  # an equal-looking work that is not the one booked
    book.clear()
    assert book.first() is None and len(book) == 0


def test_a_sequence_past_its_prediction_is_expected_to_go_on() -> None:
    assert _work("r", output=100, generated=30).expected_remaining() == 70
    assert _work("r", output=100, generated=90).expected_remaining() == 25  # a quarter more
    assert _work("r", output=2, generated=5).expected_remaining() == 1
