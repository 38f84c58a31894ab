"""Learning from what the gateway observes: prediction accuracy, prefill-model refits and
each colocated instance's queue-wait correction (predictors/queue_scale.py, from every answer
whose predicted wait mattered; the Conductor's books then scale their waits by it).

Observed prefill durations (when the instance had no queue, so the time is the prefill itself)
are collected per profile; every ``refit_interval_s`` (and every FIRST_FIT_POLL_S until a
profile's first refit) a refit runs in a worker thread (never on the event loop) and is swapped
in atomically: the Conductor's instances get a new frozen
``InstancePredictors``. A refit needs ``min_new_samples`` observations since the last one. It
trains on the observations plus the prior (the sweep of a profile measured by `kvgate profile`):
with ``min_samples`` of them a LightGBM model, with fewer the analytic P5 form, whose three
non-negative coefficients a few dozen samples pin down. (Before, a refit needed 200 no-queue
observations and nothing else counted, so a short run never refit at all.)
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from backends.stop_wait import wait_or_stop
from predictors.fitting import fit_p5
from predictors.prefill import AnalyticPrefill
from predictors.profiles import PrefillCoeffs
from predictors.queue_scale import QueueScale
from predictors.samples import PrefillSamples
from routing.conductor import Conductor
from routing.types import Decision

log = logging.getLogger("kvgate.gateway")

# Until a profile's first refit, how often the refit loop looks for enough observations.
FIRST_FIT_POLL_S = 2.0


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
    # The parts of predicted_ttft_s: the wait behind the instance's queue and the prefill.
    predicted_queue_s: float = 0.0
    predicted_prefill_s: float = 0.0

    @classmethod
    def of(cls, request_id: str, at_s: float, d: Decision) -> DecisionRecord:
        """The record of a placed request, before its answer."""
        return cls(
            request_id,
            at_s,
            d.prefill,
            d.decode,
            d.priority,
            d.reason,
            d.prompt_tokens,
            d.cached_tokens,
            d.predicted_ttft_s,
            d.predicted_tbt_s,
            predicted_queue_s=d.predicted_queue_s,
            predicted_prefill_s=d.predicted_prefill_s,
        )

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(slots=True)
class _Samples:
    new: deque[int]
    cached: deque[int]
    seconds: deque[float]
    total: int = 0  # observations ever made (the deques forget the oldest)

    @classmethod
    def window(cls, size: int) -> _Samples:
        return cls(deque(maxlen=size), deque(maxlen=size), deque(maxlen=size))


class Learner:
    def __init__(
        self,
        conductor: Conductor,
        recent: int,
        min_samples: int,
        *,
        min_new_samples: int = 20,
        window: int = 4000,
        prior: Mapping[str | None, PrefillSamples] | None = None,
        queue_scale_rate: float = 0.0,
    ) -> None:
        """``prior``: per profile key (as ``observe_prefill`` gets it), samples a refit starts
        from: a measured profile's sweep. ``queue_scale_rate``: how fast each colocated
        instance's queue-wait correction follows its answers (0: never)."""
        self.conductor = conductor
        self.decisions: deque[DecisionRecord] = deque(maxlen=recent)
        self._by_id: dict[str, DecisionRecord] = {}
        self.min_samples = min_samples
        self.min_new_samples = min_new_samples
        self.window = window  # the newest observations per profile a refit trains on
        self._prior = dict(prior or {})
        self._samples: dict[str | None, _Samples] = {}
        self._used: dict[str | None, int] = {}  # observations seen by the last refit, per key
        self.queue_scale_rate = queue_scale_rate
        self.queue_scales: dict[str, QueueScale] = {}  # per instance
        self.refits = 0
        self.last_refit_mape_pct: float | None = None
        self.last_refit_kind: str | None = None

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
            "refit_window": self.window,
            "refits": self.refits,
            "last_refit_kind": self.last_refit_kind,
            "last_refit_holdout_mape_pct": self.last_refit_mape_pct,
            "refit_min_new_samples": self.min_new_samples,
            "prior_samples": {str(k): len(v) for k, v in self._prior.items()},
            "queue_scales": {
                k: {"scale": round(q.scale, 3), "samples": q.samples}
                for k, q in sorted(self.queue_scales.items())
            },
            "lora_load": self.conductor.lora.loads.as_dict(),
        }

    # ---- prefill samples and refits ----
    def observe_prefill(
        self, profile: str | None, new_tokens: int, cached_tokens: int, seconds: float
    ) -> None:
        if not seconds > 0:
            return  # a zero time cannot be fitted on relative error
        s = self._samples.get(profile)
        if s is None:
            s = self._samples[profile] = _Samples.window(self.window)
        s.new.append(new_tokens)
        s.cached.append(cached_tokens)
        s.seconds.append(seconds)
        s.total += 1

    def observe_answer(self, d: Decision, rec: DecisionRecord, profile: str | None) -> float | None:
        """What an answered request teaches: its relative TTFT error (returned, for the
        metric), and its prefill time when nothing else was in it (no queue, no pull: the
        observed TTFT is then essentially the prefill). Shared by serve and epp."""
        observed = rec.observed_ttft_s
        if observed is None:
            return None
        # A TTFT that holds a LoRA adapter's load from disk tells neither a prefill nor a wait.
        if d.adapter_load_s is None:
            if d.predicted_queue_s == 0.0 and d.predicted_transfer_s == 0.0:
                self.observe_prefill(
                    profile, d.prompt_tokens - d.cached_tokens, d.cached_tokens, observed
                )
            elif d.prefill == d.decode and self.queue_scale_rate > 0:
                self._observe_queue(d, observed)
        if d.predicted_ttft_s > 0:
            return (observed - d.predicted_ttft_s) / d.predicted_ttft_s
        return None

    def _observe_queue(self, d: Decision, observed_ttft_s: float) -> None:
        """A colocated request's first token came after its wait and its prefill (P/D adds a
        transfer and a join the books do not predict): the wait, as the prefill model sees
        it, corrects the instance's queue scale."""
        q = self.queue_scales.get(d.prefill)
        if q is None:
            q = self.queue_scales[d.prefill] = QueueScale(self.queue_scale_rate)
        waited = observed_ttft_s - d.predicted_prefill_s - d.predicted_load_s
        if q.observe(d.predicted_queue_s, d.predicted_ttft_s, waited):
            self.conductor.set_queue_scale(d.prefill, q.scale)

    def first_fit_pending(self) -> bool:
        """Nothing refit yet, or a profile observed that has never been: its predictions are
        still the profile's as given, perhaps another engine's (a shipped GPU profile in
        front of a CPU engine predicts prefills 5-25x too fast)."""
        return not self._used or any(p not in self._used for p in self._samples)

    def training_set(self, profile: str | None) -> PrefillSamples | None:
        """Prior + observations for ``profile`` when a refit is due, else None."""
        s = self._samples.get(profile)
        if s is None or s.total - self._used.get(profile, 0) < self.min_new_samples:
            return None
        prior = self._prior.get(profile)
        new = list(s.new)
        cached = list(s.cached)
        seconds = list(s.seconds)
        if prior is not None:
            new = [*prior.new_tokens.tolist(), *new]
            cached = [*prior.cached_tokens.tolist(), *cached]
            seconds = [*prior.seconds.tolist(), *seconds]
        return PrefillSamples(
            new_tokens=np.array(new, dtype=np.int64),
            cached_tokens=np.array(cached, dtype=np.int64),
            seconds=np.array(seconds, dtype=np.float64),
            source="gateway observations" + (" + measured profile" if prior is not None else ""),
            config=None,
            includes_overhead=True,
        )

    async def refit(self) -> int:
        """Refit the prefill model of each profile with enough new samples; returns how many
        were swapped in."""
        loop = asyncio.get_running_loop()
        swapped = 0
        for profile in list(self._samples):
            samples = self.training_set(profile)
            if samples is None:
                continue
            self._used[profile] = self._samples[profile].total
            if len(samples) >= self.min_samples:
                model, report = await loop.run_in_executor(None, _train, samples)
                self.conductor.swap_prefill_model(profile, model.compiled)
                self.last_refit_mape_pct = report.mape_compiled_pct
                self.last_refit_kind = "lightgbm"
            else:
                prefill, mape = await loop.run_in_executor(None, fit_analytic_prefill, samples)
                self.conductor.swap_prefill_model(profile, prefill)
                self.last_refit_mape_pct = mape  # in-sample: too few rows to hold some out
                self.last_refit_kind = "analytic"
            self.refits += 1
            swapped += 1
        return swapped


async def refit_loop(learner: Learner, interval_s: float, stop: asyncio.Event) -> None:
    """Refits every ``interval_s`` until ``stop``; until each profile's first refit, every
    FIRST_FIT_POLL_S (when shorter): waiting a whole interval for it would leave the first
    minute's placements on a profile that may be another engine's."""
    while not stop.is_set():
        wait = min(interval_s, FIRST_FIT_POLL_S) if learner.first_fit_pending() else interval_s
        if await wait_or_stop(stop, wait):
            break
        try:
            await learner.refit()
        except Exception:  # a failed refit keeps the old model
            log.exception("prefill model refit failed")


def fit_analytic_prefill(samples: PrefillSamples) -> tuple[AnalyticPrefill, float]:
    """P5 by relative non-negative least squares; the times include the engine overhead."""
    fit = fit_p5(
        samples.new_tokens.astype(np.float64),
        samples.cached_tokens.astype(np.float64),
        samples.seconds * 1000.0,
    )
    coeffs = PrefillCoeffs(a_ms=fit.a, b_ms=fit.b, n0=fit.n0, c_ms=fit.c)
    prefill = AnalyticPrefill(
        fixed_s=coeffs.a_ms / 1000.0,
        per_token_s=coeffs.b_ms / 1000.0,
        knee_tokens=coeffs.n0,
        attn_s=coeffs.c_ms / 1000.0,
    )
    return prefill, round(fit.mape_pct, 3)


def _train(samples: PrefillSamples):
    from predictors.prefill_learned import train_prefill_model

    return train_prefill_model(samples)
