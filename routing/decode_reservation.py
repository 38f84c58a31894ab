"""Decode reservation: under decode overload, the last slice of the TBT room goes to short contexts.

Where decode binds (the 2023 LLaMA2-70B profile at 2-3x load), every admitted request adds its
whole context to each step of its decode batch (step time ``a + b*B + k*K``, K the batch's total
context: predictors/decode.py), while each counts the same in goodput. Plain admission is first
come first served: a 30k-token conversation takes the room of ten 3k-token ones whenever it
arrives while there is room. Cutting long prompts off with a fixed threshold shows the cost: on
the conversation trace at 3x / 30 s, rejecting every prompt over 15k tokens outright raised
goodput by 10 % (docs/experiments.md section 2.3, "Decode reservation").

This is the classic control of loss networks, trunk reservation: traffic that earns less per
unit of capacity is admitted only while a reserve is left for the rest. Here:

- the *cost* of a request is its prompt length, the context it adds to every step (its output
  length is not known well enough to use: median error 38-59 %, section 2.3);
- its *grade* is its rank among the last ``window`` prompts seen: none up to ``from_quantile``,
  rising linearly to 1 at the longest;
- its TBT limit is ``limit * (1 - fraction * grade)``;
- only under overload, and only where it can help: while at least ``min_pressure`` of the last
  ``pressure_window`` shorter prompts (those below ``from_quantile``, which keep the whole limit)
  failed the plain TBT check. While they get in, room held back from long prompts stays idle:
  counting every request instead (long prompts fail first) cost up to 2 % at 1x load.

Starvation is bounded twice: a long prompt is turned away by the reserve only while the decode
pool is overloaded by that measure, and its instance's checked TBT with it is above
``1 - fraction`` of the limit; and a floor waives the reserve for a prompt when the recent
prompts at least as long as it were admitted at less than ``min_admit_ratio`` of the overall
admitted share, so the reserve stops acting on a band of long prompts once it falls below that
(the plain check alone may keep it lower; the loop lags for the rarest lengths, few in a
window). Section 2.3 reports the admitted share per prompt-length band with and without the
reserve (``python -m bench.admission_bands``). A live change of the admission settings starts
the windows afresh. Pure: the caller passes every fact; nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque

from sortedcontainers import SortedList

from config.admission_settings import DecodeReservationSettings


class RecentRank:
    """Rank of a value among the last ``window`` values recorded (0 = below all of them), and the
    admitted share among the recent values at least as large."""

    __slots__ = ("_admitted", "_all", "_recent", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: deque[tuple[int, bool]] = deque()
        self._all: SortedList[int] = SortedList()
        self._admitted: SortedList[int] = SortedList()

    def __len__(self) -> int:
        return len(self._recent)

    def rank(self, value: int) -> float:
        n = len(self._all)
        return self._all.bisect_left(value) / n if n else 0.0

    def admitted_share(self, at_least: int | None = None) -> float:
        """Share admitted among the recent values >= ``at_least`` (all of them when None)."""
        if at_least is None:
            n, k = len(self._all), len(self._admitted)
        else:
            n = len(self._all) - self._all.bisect_left(at_least)
            k = len(self._admitted) - self._admitted.bisect_left(at_least)
        return k / n if n else 1.0

    def record(self, value: int, admitted: bool) -> None:
        self._recent.append((value, admitted))
        self._all.add(value)
        if admitted:
            self._admitted.add(value)
        if len(self._recent) > self.window:
            old, was_admitted = self._recent.popleft()
            self._all.remove(old)
            if was_admitted:
                self._admitted.remove(old)


class DecodeReservation:
    """The reserve each request's TBT check keeps (``reserve``), from the recent requests
    (``record`` each checked request with the verdict)."""

    __slots__ = ("_failed", "_outcomes", "prompts", "settings", "turned_away")

    def __init__(self, settings: DecodeReservationSettings) -> None:
        self.settings = settings
        self.prompts = RecentRank(settings.window)
        self._outcomes: deque[bool] = deque()  # shorter prompts' plain TBT checks: failed?
        self._failed = 0
        self.turned_away = 0  # rejections the plain check would have admitted

    @property
    def pressure(self) -> float:
        """Share of the recent shorter prompts whose plain TBT check failed."""
        return self._failed / len(self._outcomes) if self._outcomes else 0.0

    def reserve(self, prompt_tokens: int, plain_tbt_fails: bool, count: bool = True) -> float:
        """The fraction of the TBT limit this request may not use. Counts the plain check
        unless ``count`` is False (a retry of a request already counted)."""
        s = self.settings
        if not s.enabled:
            return 0.0
        rank = self.prompts.rank(prompt_tokens)
        if rank <= s.from_quantile:
            if not count:
                return 0.0
            # Pressure is counted on the prompts the reserve is for: while they pass the plain
            # check, room held back from long prompts would only stay idle.
            self._outcomes.append(plain_tbt_fails)
            self._failed += plain_tbt_fails
            if len(self._outcomes) > s.pressure_window:
                self._failed -= self._outcomes.popleft()
            return 0.0
        if self.pressure < s.min_pressure:
            return 0.0
        # The floor: prompts this long or longer keep at least ``min_admit_ratio`` of the
        # overall admitted share; below it they are judged by the plain check again.
        floor = s.min_admit_ratio * self.prompts.admitted_share()
        if self.prompts.admitted_share(prompt_tokens) < floor:
            return 0.0
        grade = min(1.0, (rank - s.from_quantile) / (1.0 - s.from_quantile))
        return s.fraction * grade

    def record(self, prompt_tokens: int, admitted: bool) -> None:
        if self.settings.enabled:
            self.prompts.record(prompt_tokens, admitted)
