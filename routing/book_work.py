"""What the books hold per request: a queued prefill, a decode (running or on its way), and
the decode work of an instance kept in order (routing/instance_books.py keeps the books)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class PrefillWork:
    request_id: str
    duration_s: float  # predicted prefill execution (incl. tier loads)
    est_start_s: float
    est_finish_s: float
    prompt_tokens: int
    ready_s: float  # earliest start (after a prefix pull)


@dataclass(slots=True, eq=False)  # identity: the sorted books find it by ``is``-fast equality
class DecodeWork:
    request_id: str
    prompt_tokens: int
    predicted_output: int
    est_arrival_s: float  # when the KV is expected to be on this instance
    # Decode step (on the instance's step clock) at which it is predicted to finish. All
    # sequences of a batch advance one token per step, so this key never goes stale when the
    # batch (and so the TBT) changes; only new token counts re-key it.
    finish_step: float = 0.0
    generated: int = 0
    started_s: float | None = None  # None while the prefill is still running
    stall_mark_s: float = 0.0  # the instance's ``prefilled_s`` when it started decoding

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def reserved_tokens(self) -> int:
        return self.prompt_tokens + max(self.predicted_output, self.generated)

    def expected_remaining(self) -> int:
        """Tokens still to come. A sequence that outlived its prediction is not about to end:
        output lengths are heavy-tailed, so keep expecting a quarter of the prediction more."""
        return max(self.predicted_output - self.generated, self.predicted_output // 4, 1)


class DecodeBook:
    """Decode work ordered by a (time, request id) key that the caller passes with each change.

    A plain list kept sorted with ``bisect``: books hold at most a batch or two of sequences,
    where this is several times cheaper per change than a general sorted container, and every
    request changes its books four or more times.
    """

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[tuple[float, str, DecodeWork]] = []

    def add(self, key: float, work: DecodeWork) -> None:
        insort(self._items, (key, work.request_id, work))

    def remove(self, key: float, work: DecodeWork) -> None:
        items = self._items
        i = bisect_left(items, (key, work.request_id))
        if i == len(items) or items[i][2] is not work:
            raise KeyError(work.request_id)
        del items[i]

    def up_to(self, key: float) -> Iterator[DecodeWork]:
        """Work with a key <= ``key``, in order."""
        items = self._items
        for i in range(bisect_right(items, (key, "\uffff"))):
            yield items[i][2]

    def __iter__(self) -> Iterator[DecodeWork]:
        """All the work, in key order."""
        return (work for _, _, work in self._items)

    def first(self) -> DecodeWork | None:
        return self._items[0][2] if self._items else None

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
