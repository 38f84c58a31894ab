"""How much of the priority classes' TBT headroom is kept, learned from the decodes' outcomes.

A class's TBT headroom (``PriorityClass.tbt_keep``) does two jobs: it leaves room for higher
classes, and it is a margin against TBT predictions that err low. When neither is needed it
costs dearly on a decode-bound fleet: a decode step has a large fixed cost (44 ms of a 100 ms
SLO for LLaMA2-70B on A100s, the 2023 profile), so keeping 10 % of the SLO leaves a quarter of
the step's variable part unused. Whether it is needed shows in what happens to the decodes
admitted: the share that then miss the TBT SLO (mean TBT over it) or that the decode engine
refuses at join. So the share of the headroom in force starts at 1 (the configured headroom)
and, over each window of finished decodes, falls while misses stay under half the target and
rises as soon as they pass it: a fleet whose TBT predictions err low (the simulator's 8B
engine runs 8 % slower than its predictor) keeps its margin; one whose predictions are right
spends it. All classes scale together, so lower classes are still shed first. Per served
model, like the other admission state. No clock: outcomes are counted, not timed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from config.admission_settings import TBTHeadroomSettings
from routing.miss_window import MissWindow


@dataclass(slots=True)
class TBTHeadroomControl:
    settings: TBTHeadroomSettings
    share: float = 1.0  # of each class's TBT headroom, in force
    raised: int = 0
    lowered: int = 0
    outcomes: MissWindow = field(default_factory=MissWindow)

    def observe(self, missed: bool) -> None:
        """One finished (or refused) decode admitted by this gateway."""
        s = self.settings
        miss = self.outcomes.add(missed, s.window) if s.adaptive else None
        if miss is None:
            return
        if miss > s.target_miss and self.share < 1.0:
            self.share = min(1.0, self.share + s.raise_step)
            self.raised += 1
        elif miss < s.target_miss / 2 and self.share > s.min_share:
            self.share = max(s.min_share, self.share - s.lower_step)
            self.lowered += 1
