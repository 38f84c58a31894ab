"""A progress bar for long runs: redraws in place on a terminal, else prints every 10 %."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._start = time.perf_counter()
        self._last_decile = -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        frac = min(done / total, 1.0)
        elapsed = time.perf_counter() - self._start
        if self._tty:
            bar = "#" * int(frac * 30)
            self.stream.write(
                f"\r{self.label:<28} [{bar:<30}] {frac:6.1%} {done}/{total} {elapsed:6.1f}s"
            )
            if done >= total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile > self._last_decile:
                self._last_decile = decile
                self.stream.write(f"{self.label}: {frac:.0%} ({done}/{total}, {elapsed:.1f}s)\n")
                self.stream.flush()
