"""Ground-truth step time of the modelled engine (calibration README section 3, form U3).

One formula drives every step, prefill-only, decode-only or mixed:
    step_ms = o + a + b*max(T, T0) + c*attn + k*K
T = tokens in the step (prefill chunk tokens + one per decoding sequence),
attn = sum over prefill chunks of n*(cached + n/2), K = context tokens of decoding sequences.
The Conductor's predictors use the separately fitted P5/D2 forms, so prediction and "reality"
differ by the calibration's form error (~3 %), as they would against a real engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from predictors.profiles import EngineProfile


@dataclass(frozen=True, slots=True)
class StepTiming:
    a_s: float
    b_s: float
    t0: int
    c_s: float
    k_s: float
    overhead_s: float

    @classmethod
    def from_profile(cls, profile: EngineProfile, overhead_ms: float | None = None) -> StepTiming:
        m = profile.mixed
        o = profile.overhead_ms if overhead_ms is None else overhead_ms
        return cls(m.a_ms / 1e3, m.b_ms / 1e3, int(m.t0), m.c_ms / 1e3, m.k_ms / 1e3, o / 1e3)

    def step(self, tokens: int, attn: float, context: int) -> float:
        return (
            self.overhead_s
            + self.a_s
            + self.b_s * (tokens if tokens > self.t0 else self.t0)
            + self.c_s * attn
            + self.k_s * context
        )

    def prefill(self, new_tokens: int, cached_tokens: int, chunk: int | None = None) -> float:
        """Time to prefill one request alone, in chunks of ``chunk`` tokens (None = one step)."""
        n = max(new_tokens, 1)
        if chunk is None or chunk >= n:
            return self.step(n, n * (cached_tokens + n / 2), 0)
        total, done = 0.0, 0
        while done < n:
            part = min(chunk, n - done)
            total += self.step(part, part * (cached_tokens + done + part / 2), 0)
            done += part
        return total

    def decode_steps(self, batch: int, context: int, steps: int) -> float:
        """Total time of ``steps`` consecutive decode steps; every sequence grows each step."""
        if steps <= 0:
            return 0.0
        first = self.step(batch, 0.0, context)
        # K grows by `batch` per step; T stays `batch` (sum of an arithmetic series).
        return steps * first + self.k_s * batch * steps * (steps - 1) / 2

    def decode_steps_until(self, batch: int, context: int, elapsed: float) -> int:
        """Smallest number of steps whose total time is >= ``elapsed`` (at least 1)."""
        if elapsed <= 0:
            return 1
        first = self.step(batch, 0.0, context)
        g = self.k_s * batch
        if g <= 0:
            s = elapsed / first
        else:
            # g/2 s^2 + (first - g/2) s - elapsed = 0
            p = first - g / 2
            s = (-p + (p * p + 2 * g * elapsed) ** 0.5) / g
        n = max(int(s), 1)
        while self.decode_steps(batch, context, n) < elapsed - 1e-12:
            n += 1
        while n > 1 and self.decode_steps(batch, context, n - 1) >= elapsed - 1e-12:
            n -= 1
        return n
