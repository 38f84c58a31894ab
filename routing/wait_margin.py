"""A margin on the predicted queue wait, learned from whether the admitted requests' first
tokens then met their TTFT SLO.

Admission keeps a promise: a request it lets in should get its first token within the TTFT
SLO. The books predict the wait behind the queue, and the instances' queue scales
(predictors/queue_scale.py) correct their mean; but a real engine's waits spread around it
(two llama-servers under 3x overload: ±25 % at p10 / p90), and admitting up to the SLO by the
mean left a tenth of the admitted requests late. The spread, not the mean, is what breaks the
promise, and only the outcomes show it (docs/real-engines.md, "Keeping the promise").

So each served model keeps a factor on the wait (1 = as predicted): over each ``window`` of
admitted requests' first tokens, a share of misses above ``target_miss`` raises it in
proportion to that share, and a window under half the target lowers it by ``lower_step``,
within [1, ``max_factor``]. It multiplies the wait only, not the prefill: the wait is what
the engine's scheduling makes uncertain, and a long prompt on a short queue keeps its chance
(no class of prompt is shut out while the queues drain). No clock: outcomes are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config.admission_settings import WaitMarginSettings
from routing.miss_window import MissWindow


@dataclass(slots=True)
class WaitMarginControl:
    settings: WaitMarginSettings
    factor: float = 1.0
    raised: int = 0
    lowered: int = 0
    outcomes: MissWindow = field(default_factory=MissWindow)

    def observe(self, missed: bool) -> None:
        """The first token of one request admitted with the TTFT promise (``missed``: after
        its TTFT SLO)."""
        s = self.settings
        miss = self.outcomes.add(missed, s.window) if s.adaptive else None
        if miss is None:
            return
        if miss > s.target_miss and self.factor < s.max_factor:
            self.factor = min(s.max_factor, self.factor * (1.0 + s.raise_gain * miss))
            self.raised += 1
        elif miss < s.target_miss / 2 and self.factor > 1.0:
            self.factor = max(1.0, self.factor * (1.0 - s.lower_step))
            self.lowered += 1

    def ttft(self, ttft_s: float, wait_s: float) -> float:
        """The TTFT admission checks: the predicted one with its wait ``wait_s`` (a part of
        it) stretched by the factor."""
        return ttft_s + (self.factor - 1.0) * wait_s
