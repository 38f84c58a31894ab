from __future__ import annotations

from routing.miss_window import MissWindow


def test_a_full_window_gives_its_share_of_misses_and_starts_over() -> None:
    w = MissWindow()
    assert [w.add(m, 4) for m in (True, False, False)] == [None, None, None]
    assert w.add(True, 4) == 0.5
    assert (w.seen, w.missed) == (0, 0)
    assert [w.add(False, 4) for _ in range(4)][-1] == 0.0
