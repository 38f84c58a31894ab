"""Outcomes counted in windows: the share of misses over each ``size`` outcomes, the signal the
learned admission margins move on (routing/tbt_headroom.py, routing/wait_margin.py). No clock:
a window is a count of outcomes, so a quiet fleet judges as slowly as it serves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class MissWindow:
    seen: int = 0  # outcomes in the window being filled
    missed: int = 0

    def add(self, missed: bool, size: int) -> float | None:
        """Count one outcome; the share of misses once ``size`` outcomes are in (the window
        starts over), else None."""
        self.seen += 1
        self.missed += missed
        if self.seen < size:
            return None
        share = self.missed / self.seen
        self.seen = self.missed = 0
        return share
