"""Prefill time models: the seam (``PrefillTimeModel``) and the analytic P5 prior.

Routing calls ``predict`` once per (request, candidate instance, cached length), so
implementations must be plain float arithmetic: no numpy, no I/O, no allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from predictors.profiles import EngineProfile


@runtime_checkable
class PrefillTimeModel(Protocol):
    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` behind ``cached_tokens`` already-cached ones."""
        ...


@dataclass(frozen=True, slots=True)
class AnalyticPrefill:
    """P5 (calibration README §3): ``a + b*max(n, n0) + c*n*(cached + n/2)`` + overhead.

    Coefficients are stored in seconds. ``fixed_s`` = a + overhead: even a full prefix-cache hit
    (n = 0) runs one forward step to produce the first token, so it costs at least that plus the
    knee term ``b*n0`` (below ``n0`` tokens the GEMMs are weight-bandwidth bound and flat).
    """

    fixed_s: float
    per_token_s: float
    knee_tokens: int
    attn_s: float  # per causal (query, key) pair

    @classmethod
    def from_profile(
        cls, profile: EngineProfile, overhead_ms: float | None = None
    ) -> AnalyticPrefill:
        """``overhead_ms`` None = the profile's default per-step overhead; 0 = GPU time only."""
        p = profile.prefill
        over = profile.overhead_ms if overhead_ms is None else overhead_ms
        return cls(
            fixed_s=(p.a_ms + over) / 1000.0,
            per_token_s=p.b_ms / 1000.0,
            knee_tokens=p.n0,
            attn_s=p.c_ms / 1000.0,
        )

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        n = new_tokens
        sat = n if n > self.knee_tokens else self.knee_tokens
        return self.fixed_s + self.per_token_s * sat + self.attn_s * n * (cached_tokens + 0.5 * n)
