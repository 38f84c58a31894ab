"""`kvgate profile`: a bounded timing sweep against a live OpenAI-compatible engine.

What it measures, one request at a time unless said otherwise:

* prefill: time to the first streamed chunk of a ``max_tokens: 1`` completion, for prompt
  lengths x cached fractions. A cold prompt starts with random token ids no other request used,
  so no engine can have it cached; a partly cached one sends its prefix first (itself a cold
  sample) and then prefix + extension. Token counts come from the engine's ``usage`` when it
  reports them (exact), else from what was sent; cached counts likewise (vLLM caches whole
  blocks only, llama.cpp any prefix of a slot).
* decode: B concurrent streams of cold prompts of a given context; the gaps between one
  stream's chunks while all B are decoding are the engine's step time at that batch and context.

Prompts go as token-id lists (vLLM, llama.cpp and kvgate's emulator accept them on
/v1/completions); an engine that refuses them gets random words instead (counts from usage).
The sweep stops at ``max_seconds`` or ``max_requests``, whichever comes first, and its order is
shuffled so a stopped sweep still covers every length. Fitting is predictors/calibration.py's.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import aiohttp

from backends.profile_plan import FIRST_TOKEN_ID, SweepPlan
from config.errors import KvgateError
from predictors.calibration import SweepSample

Progress = Callable[[int, int], None]


class ProfileError(KvgateError, RuntimeError):
    """The engine cannot be profiled (unreachable, errors on every request, no samples)."""


@dataclass
class SweepResult:
    samples: list[SweepSample] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    elapsed_s: float = 0.0
    stopped_early: bool = False
    token_ids: bool = True  # False: the engine refused token-id prompts, text was sent
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class _Timing:
    chunk_times: tuple[float, ...]  # seconds since the request was sent, one per token chunk
    prompt_tokens: int | None  # from usage / timings, when the engine reports them
    cached_tokens: int | None
    completion_tokens: int | None = None


class EngineProfiler:
    """Sends the sweep's requests to ``target`` (``http://host:port``) for ``model``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: str,
        model: str,
        plan: SweepPlan,
        *,
        progress: Progress | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.session = session
        self.url = target.rstrip("/") + "/v1/completions"
        self.model = model
        self.plan = plan
        self.progress = progress or (lambda done, total: None)
        self.clock = clock
        # Token ids from system entropy, not the plan's seed: a prompt of an earlier sweep
        # may still sit in the engine's cache, and a cold sample must be cold.
        self.rng = random.Random()
        self.result = SweepResult()
        self._total = plan.planned_requests()
        self._deadline = 0.0

    # ------------------------------------------------------------------ prompts
    def _prompt(self, tokens: Sequence[int]) -> list[int] | str:
        if self.result.token_ids:
            return list(tokens)
        # Text fallback: one short pseudo-word per id; counts then come from usage.
        return " ".join(f"w{t}" for t in tokens)

    def _cold(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_TOKEN_ID, self.plan.vocab_size) for _ in range(n)]

    # ------------------------------------------------------------------ requests
    def _out_of_budget(self) -> bool:
        over = self.clock() >= self._deadline or self.result.requests >= self.plan.max_requests
        if over:
            self.result.stopped_early = True
        return over

    async def _stream(self, tokens: Sequence[int], max_tokens: int) -> _Timing | None:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": self._prompt(tokens),
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "ignore_eos": True,
        }
        self.result.requests += 1
        self.progress(min(self.result.requests, self._total), self._total)
        t0 = self.clock()
        times: list[float] = []
        prompt_tokens = cached = completion = None
        timeout = aiohttp.ClientTimeout(total=self.plan.request_timeout_s)
        try:
            async with self.session.post(self.url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    if resp.status == 400 and self.result.token_ids and "prompt" in text.lower():
                        self.result.token_ids = False  # retried as text by the caller
                    self.result.errors += 1
                    self.result.last_error = f"HTTP {resp.status}: {text}"
                    return None
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    now = self.clock() - t0
                    chunk = json.loads(data)
                    # The first chunk with a choice is the first token even with empty text
                    # (max_tokens 1: vLLM's only chunk also names the finish reason).
                    if _is_token_chunk(chunk) or (not times and chunk.get("choices")):
                        times.append(now)
                    prompt_tokens, cached = _usage(chunk, prompt_tokens, cached)
                    usage = chunk.get("usage")
                    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                        completion = usage["completion_tokens"]
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.result.errors += 1
            self.result.last_error = f"{type(exc).__name__}: {exc}"
            return None
        if not times:
            self.result.errors += 1
            self.result.last_error = "the stream carried no token chunk"
            return None
        return _Timing(tuple(times), prompt_tokens, cached, completion)

    async def _stream_retrying_as_text(
        self, tokens: Sequence[int], max_tokens: int
    ) -> _Timing | None:
        was_ids = self.result.token_ids
        timing = await self._stream(tokens, max_tokens)
        if timing is None and was_ids and not self.result.token_ids:
            timing = await self._stream(tokens, max_tokens)
        return timing

    async def _prefill_sample(self, tokens: Sequence[int], cached_sent: int) -> None:
        t = await self._stream_retrying_as_text(tokens, 1)
        if t is None:
            return
        n_total = t.prompt_tokens if t.prompt_tokens is not None else len(tokens)
        cached = t.cached_tokens if t.cached_tokens is not None else cached_sent
        cached = max(0, min(cached, n_total - 1))
        self.result.samples.append(
            SweepSample(new_tokens=n_total - cached, cached_tokens=cached, seconds=t.chunk_times[0])
        )

    async def _prefill_case(self, length: int, fraction: float) -> None:
        prefix_len = int(length * fraction)
        if prefix_len <= 0:
            await self._prefill_sample(self._cold(length), 0)
            return
        prefix = self._cold(prefix_len)
        await self._prefill_sample(prefix, 0)  # warms the prefix; itself a cold sample
        if self._out_of_budget():
            return
        extension = self._cold(length - prefix_len)
        await self._prefill_sample(prefix + extension, prefix_len)

    async def _decode_case(self, batch: int, context: int) -> None:
        streams = await asyncio.gather(
            *(self._stream(self._cold(context), self.plan.decode_tokens) for _ in range(batch))
        )
        timings = [t for t in streams if t is not None and len(t.chunk_times) >= 2]
        self.result.samples.extend(decode_samples(timings, context))

    # ------------------------------------------------------------------ the sweep
    async def run(self) -> SweepResult:
        start = self.clock()
        self._deadline = start + self.plan.max_seconds
        # A first request pays one-off costs (graph capture, allocations): not a sample.
        warm = await self._stream_retrying_as_text(self._cold(32), 1)
        if warm is None:
            raise ProfileError(f"{self.url}: the engine did not answer: {self.result.last_error}")
        for length, fraction in self.plan.prefill_cases():
            if self._out_of_budget():
                break
            await self._prefill_case(length, fraction)
        for batch, context in self.plan.decode_cases():
            if self._out_of_budget():
                break
            await self._decode_case(batch, context)
        self.result.elapsed_s = self.clock() - start
        self.progress(self._total, self._total)
        return self.result


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    """A chunk carrying a token: llama.cpp ends with an empty-text chunk naming the finish
    reason, vLLM with a usage-only chunk (no choices); neither is a token."""
    choices = chunk.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return False
    first = choices[0]
    return bool(first.get("text")) or first.get("finish_reason") is None


def _usage(
    chunk: dict[str, Any], prompt_tokens: int | None, cached: int | None
) -> tuple[int | None, int | None]:
    """Prompt and cached token counts from an OpenAI ``usage`` or llama.cpp ``timings``."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = details["cached_tokens"]
    timings = chunk.get("timings")
    if isinstance(timings, dict):  # llama.cpp: cache_n reused, prompt_n computed
        cache_n, prompt_n = timings.get("cache_n"), timings.get("prompt_n")
        if isinstance(cache_n, int) and isinstance(prompt_n, int):
            cached, prompt_tokens = cache_n, cache_n + prompt_n
    return prompt_tokens, cached


BURST_GAP_S = 20e-6  # closer than this, two chunks came in one read, not one step apart


def _burst(times: Sequence[float]) -> bool:
    return statistics.median(b - a for a, b in pairwise(times)) < BURST_GAP_S


def decode_samples(timings: Sequence[_Timing], context: int) -> list[SweepSample]:
    """One decode sample per distinct concurrency: per stream, its step time is the span from
    its first to its last chunk over the tokens produced in between (from usage when reported:
    a lagging vLLM API server merges several steps into one chunk, so gaps between chunks are
    not steps), at the batch it ran in: 1 + the time-weighted overlap of the other streams.
    Per batch size, the median over streams. A stream read in a burst (most gaps between its
    chunks under ``BURST_GAP_S``: the server flushed a backlog at once) is no sample: once,
    against a real vLLM, every stream of a sweep did that and the fit put a step at 7 us
    (2 ms measured alone)."""
    spans = [(t.chunk_times[0], t.chunk_times[-1]) for t in timings]
    found: dict[int, list[tuple[float, float]]] = {}  # batch -> (step seconds, tokens)
    for i, t in enumerate(timings):
        first, last = spans[i]
        tokens = t.completion_tokens or len(t.chunk_times)
        # A stream whose tokens arrived in one or two bursts tells nothing about steps.
        if len(t.chunk_times) < 4 or tokens < 3 or last <= first or _burst(t.chunk_times):
            continue
        overlap = sum(
            max(0.0, min(last, b) - max(first, a)) for j, (a, b) in enumerate(spans) if j != i
        )
        batch = round(1 + overlap / (last - first))
        found.setdefault(batch, []).append(((last - first) / (tokens - 1), tokens / 2))
    out = []
    for batch, rows in sorted(found.items()):
        step = statistics.median(s for s, _ in rows)
        grown = statistics.median(g for _, g in rows)
        if step > 0:
            out.append(
                SweepSample(
                    batch=batch, context_tokens=int(batch * (context + grown)), seconds=step
                )
            )
    return out
