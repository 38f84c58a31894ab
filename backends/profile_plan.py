"""What `kvgate profile` sweeps: the plan (data only, cheap to import for the CLI's parser)."""

from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_PROMPT_TOKENS = (64, 128, 256, 512, 1024, 2048, 3072)
DEFAULT_CACHED_FRACTIONS = (0.0, 0.5, 0.9)
DEFAULT_BATCH_SIZES = (1, 2, 4)
DEFAULT_DECODE_CONTEXTS = (128, 1024)
FIRST_TOKEN_ID = 10  # skip the special tokens at the bottom of most vocabularies


@dataclass(frozen=True, slots=True)
class SweepPlan:
    prompt_tokens: tuple[int, ...] = DEFAULT_PROMPT_TOKENS
    cached_fractions: tuple[float, ...] = DEFAULT_CACHED_FRACTIONS
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    decode_contexts: tuple[int, ...] = DEFAULT_DECODE_CONTEXTS
    repeats: int = 3  # fitted on each case's median: robust to a slow outlier
    decode_tokens: int = 24  # per decode stream; the first few gaps are dropped
    max_seconds: float = 180.0
    max_requests: int = 400
    vocab_size: int = 1000  # token ids are drawn from [FIRST_TOKEN_ID, vocab_size)
    request_timeout_s: float = 120.0
    seed: int = 0

    def prefill_cases(self) -> list[tuple[int, float]]:
        rng = random.Random(self.seed)
        cases = [
            (n, f)
            for _ in range(self.repeats)
            for n in self.prompt_tokens
            for f in self.cached_fractions
        ]
        rng.shuffle(cases)
        return cases

    def decode_cases(self) -> list[tuple[int, int]]:
        return [(b, ctx) for ctx in self.decode_contexts for b in self.batch_sizes]

    def planned_requests(self) -> int:
        prefill = sum(2 if f > 0 else 1 for _, f in self.prefill_cases())
        return 1 + prefill + sum(b for b, _ in self.decode_cases())
