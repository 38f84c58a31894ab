"""Output-length prediction from recent history, per prefix key with a global fallback.

Requests sharing a key (e.g. a hash of the system-prompt prefix) tend to produce similar output
lengths. ``predict`` is on the routing path, so every estimate is computed at ``observe`` time
and ``predict`` is a dict lookup plus a clamp. Memory is bounded: ``history`` outputs per key,
``max_keys`` keys (least-recently-observed evicted) and a ``global_window`` of recent outputs.

Most keys are seen once (a unique prompt's first block): such a key keeps its one output as a
plain int (~0.15 KB) and gets a window only when it comes back. A window for every key cost
~1.1 KB each, which at the old bound of 100,000 keys was a 107 MB structure that a 30-minute
soak saw as a steady RSS creep (docs/reliability.md).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from config.settings import PredictorSettings


def quantile(values: Iterable[int], q: float) -> int:
    """Linear-interpolation quantile (numpy's default), rounded to whole tokens."""
    return _sorted_quantile(sorted(values), q)


def _sorted_quantile(s: Sequence[int], q: float) -> int:
    if not s:
        raise ValueError("quantile of no values")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return round(s[lo] + (s[hi] - s[lo]) * (pos - lo))


class _Window:
    """The last ``size`` values, also kept sorted: a quantile is an index, not a sort (this
    runs for every finished request). A list used as a ring (a deque allocates 64 slots)."""

    __slots__ = ("_next", "_ring", "_size", "_sorted")

    def __init__(self, size: int) -> None:
        self._size = size
        self._ring: list[int] = []
        self._next = 0  # the oldest value's slot once the ring is full
        self._sorted: list[int] = []

    def add(self, value: int) -> None:
        if len(self._ring) < self._size:
            self._ring.append(value)
        else:
            old = self._ring[self._next]
            del self._sorted[bisect_left(self._sorted, old)]
            self._ring[self._next] = value
            self._next = (self._next + 1) % self._size
        insort(self._sorted, value)

    def quantile(self, q: float) -> int:
        return _sorted_quantile(self._sorted, q)

    def __len__(self) -> int:
        return len(self._ring)


class _KeyHistory:
    __slots__ = ("estimate", "outputs")

    def __init__(self, history: int) -> None:
        self.outputs = _Window(history)
        self.estimate = 0


class OutputLengthPredictor:
    def __init__(
        self,
        history: int,
        quantile: float,
        default_tokens: int,
        *,
        max_keys: int = 32_768,
        global_window: int = 4096,
        global_refresh: int = 64,
    ) -> None:
        if history < 1 or max_keys < 1 or global_window < 1 or global_refresh < 1:
            raise ValueError("history, max_keys, global_window and global_refresh must be >= 1")
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        if default_tokens < 1:
            raise ValueError("default_tokens must be >= 1")
        self.history = history
        self.quantile = quantile
        self.default_tokens = default_tokens
        self.max_keys = max_keys
        self.global_refresh = global_refresh
        # A key seen once holds its output (int); seen again, a window of its outputs.
        self._keys: OrderedDict[int, int | _KeyHistory] = OrderedDict()
        self._recent = _Window(global_window)
        self._global: int | None = None
        self._since_refresh = 0

    @classmethod
    def from_settings(cls, settings: PredictorSettings) -> OutputLengthPredictor:
        return cls(
            settings.output_length_history,
            settings.output_length_quantile,
            settings.default_output_tokens,
        )

    def observe(self, key: int | None, output_tokens: int) -> None:
        """Record a finished request's output length (``key`` None: global history only)."""
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        if key is not None:
            entry = self._keys.get(key)
            if entry is None:
                self._keys[key] = output_tokens  # its estimate: the quantile of one value
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
                if isinstance(entry, int):  # back again: now it needs a window
                    first, entry = entry, _KeyHistory(self.history)
                    entry.outputs.add(first)
                    self._keys[key] = entry
                entry.outputs.add(output_tokens)
                entry.estimate = entry.outputs.quantile(self.quantile)  # predict stays O(1)
        self._recent.add(output_tokens)
        self._since_refresh += 1
        # The global estimate is refreshed every `global_refresh` observations (and on the
        # first, so the default is used only before any data).
        if self._global is None or self._since_refresh >= self.global_refresh:
            self._global = self._recent.quantile(self.quantile)
            self._since_refresh = 0

    def predict(self, key: int | None, max_tokens: int) -> int:
        """Per-key estimate, else the global one, else the default; clamped to [1, max_tokens]
        (1 if ``max_tokens`` < 1: a request always produces at least one token)."""
        entry = self._keys.get(key) if key is not None else None
        if entry is not None:
            est = entry if isinstance(entry, int) else entry.estimate
        elif self._global is not None:
            est = self._global
        else:
            est = self.default_tokens
        if est > max_tokens:
            est = max_tokens
        return est if est >= 1 else 1

    @property
    def tracked_keys(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys
