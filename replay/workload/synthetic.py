"""Synthetic workloads in the Mooncake trace format, deterministic for a seed.

A workload is an arrival process (Poisson, or gamma with a chosen coefficient of variation
for burstier traffic), prompt/output length distributions, and prefix structure:

* prefix families (e.g. shared system prompts) of a fixed number of blocks, picked with Zipf
  popularity, cover a chosen fraction of new conversations;
* optional multi-turn conversations: a follow-up prompt is the previous prompt, its answer
  and a new user turn, so it repeats the previous prompt's full blocks.

Hash ids follow the Mooncake chained semantics: an id names a block *and* everything before
it, so two requests share their first k ids exactly when they share a k-block prefix. Ids
are allocated in order of first appearance, like the published traces.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from replay.workload.traces import BLOCK_SIZE, TraceRequest, blocks_for

LENGTH_KINDS = ("fixed", "uniform", "lognormal")
ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Token-length distribution; draws are rounded and clipped to [low, high]."""

    kind: str = "lognormal"  # "fixed" | "uniform" | "lognormal"
    mean: float = 1024.0  # fixed: the value; lognormal: mean before clipping
    sigma: float = 0.5  # lognormal: standard deviation of log(length)
    low: int = 1  # uniform: lower bound; all kinds: clip
    high: int = 131_072  # uniform: upper bound (inclusive); all kinds: clip

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind {self.kind!r} unknown; known: {', '.join(LENGTH_KINDS)}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low} high={self.high}")
        if self.mean <= 0 or self.sigma < 0:
            raise ValueError(f"need mean > 0 and sigma >= 0, got {self.mean}, {self.sigma}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            raw = np.full(n, float(self.mean))
        elif self.kind == "uniform":
            raw = rng.integers(self.low, self.high + 1, size=n).astype(float)
        else:
            # E[exp(N(mu, s^2))] = exp(mu + s^2/2), so mu is chosen to hit the requested mean.
            mu = np.log(self.mean) - self.sigma**2 / 2
            raw = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(raw), self.low, self.high).astype(np.int64)


def fixed(tokens: int) -> LengthDist:
    return LengthDist("fixed", mean=tokens, sigma=0.0, low=tokens, high=tokens)


def uniform(low: int, high: int) -> LengthDist:
    return LengthDist("uniform", mean=(low + high) / 2, sigma=0.0, low=low, high=high)


def lognormal(mean: float, sigma: float, low: int = 1, high: int = 131_072) -> LengthDist:
    return LengthDist("lognormal", mean=mean, sigma=sigma, low=low, high=high)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    requests: int | None = 1000  # stop after this many requests ...
    duration_s: float | None = None  # ... or at this time (whichever comes first)
    rate_rps: float = 1.0
    arrival: str = "poisson"  # "poisson" | "gamma"
    cv: float = 1.0  # gamma: coefficient of variation of inter-arrival gaps (1 = Poisson)
    input_len: LengthDist = field(default_factory=lambda: lognormal(1024, 0.5))
    output_len: LengthDist = field(default_factory=lambda: lognormal(256, 0.5))
    families: int = 0  # number of shared-prefix families (system prompts)
    family_zipf: float = 1.0  # popularity of family rank r is proportional to r**-zipf
    family_prefix_blocks: int = 4  # full blocks every member of a family shares
    family_fraction: float = 0.0  # share of new conversations that belong to a family
    followup_prob: float = 0.0  # chance a request continues an open conversation
    max_conversations: int = 64  # open conversations a follow-up may continue (FIFO)
    max_context_tokens: int = 131_072  # a conversation that would outgrow this ends
    block_size: int = BLOCK_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give requests or duration_s (or both)")
        if self.requests is not None and self.requests < 0:
            raise ValueError(f"requests must be >= 0, got {self.requests}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.rate_rps <= 0 or self.cv <= 0:
            raise ValueError(f"need rate_rps > 0 and cv > 0, got {self.rate_rps}, {self.cv}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival {self.arrival!r} unknown; known: {', '.join(ARRIVALS)}")
        for name in ("family_fraction", "followup_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.family_fraction > 0 and self.families < 1:
            raise ValueError("family_fraction > 0 needs families >= 1")
        if self.families < 0 or self.family_zipf < 0 or self.family_prefix_blocks < 1:
            raise ValueError("need families >= 0, family_zipf >= 0, family_prefix_blocks >= 1")
        if self.max_conversations < 1 or self.block_size < 1:
            raise ValueError("need max_conversations >= 1 and block_size >= 1")


def chat_spec(
    *,
    requests: int | None = 2000,
    duration_s: float | None = None,
    rate_rps: float = 4.0,
    families: int = 16,
    family_fraction: float = 0.5,
    followup_prob: float = 0.0,
    seed: int = 0,
) -> SyntheticSpec:
    """Chat-like preset (~1k prompt / ~300 output tokens, Poisson), for EcoServe-style runs.

    Family members share one 512-token system prompt. Follow-ups are off by default because
    they grow prompts turn by turn and would move the mean input away from ~1k.
    """
    return SyntheticSpec(
        requests=requests,
        duration_s=duration_s,
        rate_rps=rate_rps,
        input_len=lognormal(1000, 0.7, low=32, high=8192),
        output_len=lognormal(300, 0.7, low=1, high=2048),
        families=families,
        family_prefix_blocks=1,
        family_fraction=family_fraction,
        followup_prob=followup_prob,
        seed=seed,
    )


def _arrivals(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (first at 0), truncated by ``requests`` and ``duration_s``."""
    if spec.arrival == "poisson":
        shape, scale = 1.0, 1.0 / spec.rate_rps  # gamma(1, 1/rate) is the exponential
    else:
        shape = 1.0 / spec.cv**2
        scale = 1.0 / (spec.rate_rps * shape)
    if spec.requests is not None:
        gaps = rng.gamma(shape, scale, size=max(spec.requests - 1, 0))
        times = np.concatenate([[0.0], np.cumsum(gaps)])[: spec.requests]
    else:
        duration = float(spec.duration_s or 0.0)  # __post_init__ guarantees one of the two
        chunks, total = [np.zeros(1)], 0.0
        chunk = int(spec.rate_rps * duration * 1.1) + 16
        while total < duration:
            gaps = np.cumsum(rng.gamma(shape, scale, size=chunk)) + total
            chunks.append(gaps)
            total = float(gaps[-1])
        times = np.concatenate(chunks)
    if spec.duration_s is not None:
        times = times[times < spec.duration_s]
    return times


@dataclass(slots=True)
class _Conversation:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def generate(spec: SyntheticSpec) -> list[TraceRequest]:
    """Requests in arrival order; the same spec (including seed) gives the same list."""
    # Independent streams per aspect, each drawn in request order, so switching the arrival
    # process does not reshuffle lengths, and a shorter run is a prefix of a longer one.
    arr_rng, in_rng, out_rng, pick_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(4)
    )
    times = _arrivals(spec, arr_rng)
    n = len(times)
    inputs = spec.input_len.sample(in_rng, n)
    outputs = spec.output_len.sample(out_rng, n)
    u_follow, u_family, u_which, u_conv = pick_rng.random((n, 4)).T
    popularity = np.arange(1, spec.families + 1, dtype=float) ** -spec.family_zipf
    family_cdf = np.cumsum(popularity) / popularity.sum() if spec.families else popularity

    bs = spec.block_size
    next_id = 0
    family_ids: dict[int, tuple[int, ...]] = {}
    open_convs: list[_Conversation] = []

    def fresh(k: int) -> tuple[int, ...]:
        nonlocal next_id
        next_id += k
        return tuple(range(next_id - k, next_id))

    out: list[TraceRequest] = []
    for i in range(n):
        n_out = int(outputs[i])
        prefix: tuple[int, ...] = ()
        n_in = int(inputs[i])
        slot: int | None = None  # the open conversation this request continues
        if open_convs and u_follow[i] < spec.followup_prob:
            pick = int(u_conv[i] * len(open_convs))
            prev = open_convs[pick]
            grown = prev.input_length + prev.output_length + n_in
            if grown <= spec.max_context_tokens:
                # Only full blocks carry over: the previous partial last block now holds
                # more tokens, so its chained id changes.
                prefix, n_in, slot = prev.hash_ids[: prev.input_length // bs], grown, pick
            else:
                open_convs.pop(pick)  # the conversation ends; this request starts afresh
        if slot is None and spec.families and u_family[i] < spec.family_fraction:
            fam = min(int(np.searchsorted(family_cdf, u_which[i], side="right")), spec.families - 1)
            if fam not in family_ids:
                family_ids[fam] = fresh(spec.family_prefix_blocks)
            prefix = family_ids[fam]
            # A member always carries its whole system prompt plus at least one token.
            n_in = max(n_in, spec.family_prefix_blocks * bs + 1)
        ids = prefix + fresh(blocks_for(n_in, bs) - len(prefix))
        out.append(TraceRequest(i, float(times[i]), n_in, n_out, ids))
        if spec.followup_prob > 0:
            state = _Conversation(n_in, n_out, ids)
            if slot is not None:
                open_convs[slot] = state
            else:
                open_convs.append(state)
                if len(open_convs) > spec.max_conversations:
                    open_convs.pop(0)
    return out


def write_mooncake(requests: Iterable[TraceRequest], path: str | Path) -> None:
    """Write Mooncake JSONL (``timestamp`` in ms, sub-ms kept to 3 decimals)."""
    lines = []
    for r in requests:
        if len(r.hash_ids) != blocks_for(r.input_length):
            raise ValueError(
                f"request {r.index}: {len(r.hash_ids)} hash ids for {r.input_length} tokens; "
                f"the Mooncake format needs ceil(input_length/{BLOCK_SIZE})"
            )
        ms = round(r.arrival_s * 1000.0, 3)
        rec = {
            "timestamp": int(ms) if ms.is_integer() else ms,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
        }
        lines.append(json.dumps(rec) + "\n")
    Path(path).write_text("".join(lines), encoding="utf-8")
