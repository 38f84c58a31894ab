"""How much of the colocated decodes' future TBT slack the prefill-stall check may count on,
learned from their outcomes.

``routing/prefill_stall.py`` lets a prefill onto a colocated instance when every decode there
that can still meet the TBT SLO keeps its slack: what it saved so far plus what its remaining
tokens will save, ``credit`` x their number x (SLO - decode step). The remaining tokens are a
prediction, and a heavy-tailed one: a decode predicted to make 300 more tokens that makes 20
takes a stall sized for 300 and misses. So the credit is a hedge, and how large a hedge a
fleet needs depends on its step times and its traffic (simulated, conversation trace, 8
colocated: the best fixed credit was 0.1-0.15 with the default profile and 0.25 with the
2023 one, whose larger fixed step cost leaves less slack to spend; docs/experiments.md
§2.7). Each served model keeps its own, learned as the TBT headroom is: over each window of
finished colocated decodes, a share of misses above ``target_miss`` multiplies the credit by
``lower_factor``, one under half of it raises it by ``raise_step``, within [0, ``max_credit``].
A miss counts only when the prefills the decode sat through made it (without their predicted
work it would have met the SLO; RequestProgress.finished): an engine stalled by its host
misses whatever the check does, and learning from that only turned requests away (two vLLM
CPU engines on two shared cores, docs/real-engines.md). No clock: outcomes are counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config.admission_settings import PrefillStallSettings
from routing.miss_window import MissWindow


@dataclass(slots=True)
class StallCreditControl:
    settings: PrefillStallSettings
    credit: float
    raised: int = 0
    lowered: int = 0
    outcomes: MissWindow = field(default_factory=MissWindow)

    @classmethod
    def start(cls, settings: PrefillStallSettings) -> StallCreditControl:
        """At the configured credit."""
        return cls(settings, settings.credit)

    def observe(self, missed: bool) -> None:
        """One finished decode of a colocated instance (``missed``: over its TBT SLO because
        of the prefills it sat through)."""
        s = self.settings
        miss = self.outcomes.add(missed, s.window) if s.adaptive else None
        if miss is None:
            return
        if miss > s.target_miss and self.credit > 0.0:
            self.credit *= s.lower_factor
            self.lowered += 1
        elif miss < s.target_miss / 2 and self.credit < s.max_credit:
            self.credit = min(s.max_credit, self.credit + s.raise_step)
            self.raised += 1
