"""Learning from what the gateway observes: prediction accuracy and prefill-model refits.

Observed prefill durations (when the instance had no queue, so the time is the prefill itself)
are collected per profile; every ``refit_interval_s`` with enough samples a LightGBM prefill
model is trained in a worker thread (never on the event loop) and swapped in atomically: the
Conductor's instances get a new frozen ``InstancePredictors``.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from predictors.samples import PrefillSamples
from routing.conductor import Conductor


@dataclass(slots=True)
class DecisionRecord:
    request_id: str
    at_s: float
    prefill: str
    decode: str
    priority: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    observed_ttft_s: float | None = None
    observed_tbt_s: float | None = None
    outcome: str = "in_flight"

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(slots=True)
class _Samples:
    new: deque[int] = field(default_factory=lambda: deque(maxlen=20_000))
    cached: deque[int] = field(default_factory=lambda: deque(maxlen=20_000))
    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=20_000))


class Learner:
    def __init__(self, conductor: Conductor, recent: int, min_samples: int) -> None:
        self.conductor = conductor
        self.decisions: deque[DecisionRecord] = deque(maxlen=recent)
        self._by_id: dict[str, DecisionRecord] = {}
        self.min_samples = min_samples
        self._samples: dict[str | None, _Samples] = {}
        self.refits = 0
        self.last_refit_mape_pct: float | None = None

    # ---- decisions and accuracy ----
    def record(self, rec: DecisionRecord) -> None:
        if len(self.decisions) == self.decisions.maxlen:
            old = self.decisions[0]
            self._by_id.pop(old.request_id, None)
        self.decisions.append(rec)
        self._by_id[rec.request_id] = rec

    def get(self, request_id: str) -> DecisionRecord | None:
        return self._by_id.get(request_id)

    def accuracy(self) -> dict[str, object]:
        ttft = [
            abs(r.observed_ttft_s - r.predicted_ttft_s) / r.observed_ttft_s
            for r in self.decisions
            if r.observed_ttft_s and r.observed_ttft_s > 0
        ]
        tbt = [
            abs(r.observed_tbt_s - r.predicted_tbt_s) / r.observed_tbt_s
            for r in self.decisions
            if r.observed_tbt_s and r.observed_tbt_s > 0
        ]
        return {
            "window": len(self.decisions),
            "ttft_samples": len(ttft),
            "ttft_mape_pct": round(statistics.fmean(ttft) * 100, 2) if ttft else None,
            "tbt_samples": len(tbt),
            "tbt_mape_pct": round(statistics.fmean(tbt) * 100, 2) if tbt else None,
            "prefill_samples": {str(k): len(v.seconds) for k, v in self._samples.items()},
            "refits": self.refits,
            "last_refit_holdout_mape_pct": self.last_refit_mape_pct,
        }

    # ---- prefill samples and refits ----
    def observe_prefill(
        self, profile: str | None, new_tokens: int, cached_tokens: int, seconds: float
    ) -> None:
        s = self._samples.setdefault(profile, _Samples())
        s.new.append(new_tokens)
        s.cached.append(cached_tokens)
        s.seconds.append(seconds)

    async def refit(self) -> int:
        """Train a prefill model per profile with enough samples; returns how many swapped."""
        loop = asyncio.get_running_loop()
        swapped = 0
        for profile, s in list(self._samples.items()):
            if len(s.seconds) < self.min_samples:
                continue
            samples = PrefillSamples(
                new_tokens=np.array(s.new, dtype=np.int64),
                cached_tokens=np.array(s.cached, dtype=np.int64),
                seconds=np.array(s.seconds, dtype=np.float64),
                source="gateway observations",
                config=None,
                includes_overhead=True,
            )
            model, report = await loop.run_in_executor(None, _train, samples)
            self._swap(profile, model.compiled)
            self.last_refit_mape_pct = report.mape_compiled_pct
            self.refits += 1
            swapped += 1
        return swapped

    def _swap(self, profile: str | None, prefill_model: object) -> None:
        """Atomic from the event loop's point of view: one reference per instance changes."""
        c = self.conductor
        cache: dict[int, object] = {}
        for inst in c.instances.values():
            spec_profile = inst.predictors.profile.name
            if profile is not None and spec_profile != profile:
                continue
            key = id(inst.predictors)
            if key not in cache:
                cache[key] = replace(inst.predictors, prefill=prefill_model)
            inst.predictors = cache[key]  # type: ignore[assignment]


def _train(samples: PrefillSamples):
    from predictors.prefill_learned import train_prefill_model

    return train_prefill_model(samples)
