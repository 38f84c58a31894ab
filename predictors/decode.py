"""Decode step time: D2 ``a + b*B + k*K`` (calibration README §3, MAPE 1.5-5.3 %) + overhead.

B = sequences in the decode batch, K = their total context tokens (the KV read per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from predictors.fitting import relative_nnls
from predictors.profiles import EngineProfile
from predictors.samples import parse_timing_csv

GRID_DECODE_COLUMNS = ("config", "batch", "ctx_per_seq", "ctx_total", "gpu_ms")
OBSERVED_DECODE_COLUMNS = ("batch", "context_tokens", "step_s")


@dataclass(frozen=True, eq=False)  # numpy arrays inside: identity equality
class DecodeSamples:
    batch: NDArray[np.int64]
    context_tokens: NDArray[np.int64]  # total over the batch (K)
    seconds: NDArray[np.float64]
    source: str
    config: str | None = None
    includes_overhead: bool = True  # False for the calibration grid (GPU time only)

    def __len__(self) -> int:
        return len(self.seconds)


def parse_decode_samples(text: str, source: str, config: str | None = None) -> DecodeSamples:
    """Calibration decode grid (``config,batch,ctx_per_seq,ctx_total,gpu_ms``) or kvgate observed
    steps (``batch,context_tokens,step_s``). Bad rows raise ``ValueError`` naming file and line."""
    cols = parse_timing_csv(
        text,
        source,
        config,
        (GRID_DECODE_COLUMNS, ("batch", "ctx_total", "gpu_ms")),
        OBSERVED_DECODE_COLUMNS,
    )
    return DecodeSamples(
        cols.first, cols.second, cols.seconds, source, cols.config, cols.includes_overhead
    )


@dataclass(frozen=True, slots=True)
class DecodeStepModel:
    a_ms: float
    b_ms: float
    k_ms: float
    overhead_ms: float = 0.0
    # Seconds, precomputed: step_time runs for every candidate decode instance and forecast.
    _fixed_s: float = field(init=False, repr=False, compare=False)
    _per_seq_s: float = field(init=False, repr=False, compare=False)
    _per_ctx_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fixed_s", (self.a_ms + self.overhead_ms) / 1000.0)
        object.__setattr__(self, "_per_seq_s", self.b_ms / 1000.0)
        object.__setattr__(self, "_per_ctx_s", self.k_ms / 1000.0)

    @classmethod
    def from_profile(
        cls, profile: EngineProfile, overhead_ms: float | None = None
    ) -> DecodeStepModel:
        """``overhead_ms`` None = the profile's default per-step overhead; 0 = GPU time only."""
        d = profile.decode
        over = profile.overhead_ms if overhead_ms is None else overhead_ms
        return cls(a_ms=d.a_ms, b_ms=d.b_ms, k_ms=d.k_ms, overhead_ms=over)

    def step_time(self, batch: int, context_tokens: int) -> float:
        """Seconds per decode step (= TBT) for ``batch`` sequences holding ``context_tokens``
        in total. An empty batch runs no step: 0.0."""
        if batch <= 0:
            return 0.0
        return self._fixed_s + self._per_seq_s * batch + self._per_ctx_s * context_tokens

    @classmethod
    def fit(cls, samples: DecodeSamples, *, overhead_ms: float = 0.0) -> DecodeStepModel:
        """Non-negative least squares on relative error (as the calibration fits).

        Observed steps already include the engine overhead, so it lands in ``a`` and
        ``overhead_ms`` stays 0; pass it explicitly when fitting GPU-only grid samples."""
        if len(samples) < 3:
            raise ValueError("need at least 3 decode samples to fit a, b, k")
        b = samples.batch.astype(np.float64)
        k = samples.context_tokens.astype(np.float64)
        x = np.stack([np.ones_like(b), b, k], axis=1)
        a_c, b_c, k_c = relative_nnls(x, samples.seconds * 1000.0)
        return cls(a_ms=float(a_c), b_ms=float(b_c), k_ms=float(k_c), overhead_ms=overhead_ms)
