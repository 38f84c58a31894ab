"""What an engine's answer says about its prefix cache, set against what kvgate predicted.

Engines report how many prompt tokens they found cached: vLLM in
``usage.prompt_tokens_details.cached_tokens`` (with ``--enable-prompt-tokens-details``; whole
blocks), llama.cpp in the same field and in ``timings.cache_n``. The count is in the engine's
tokens, kvgate's blocks in its own (the same tokens with the model's tokenizer, roughly the
same with the approximate one), so a report is scaled by the ratio of the two prompt lengths
when they differ. Pure arithmetic; the Conductor applies the result to its KV index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)  # not frozen: one is made per answered request, frozen init costs 2x
class CacheFeedback:
    """One answered request: kvgate's prediction and the engine's report, in kvgate's tokens."""

    instance_id: str
    prompt_tokens: int
    predicted_cached_tokens: int  # what the placement assumed was cached
    engine_cached_tokens: int | None  # the engine's report (None: it reported nothing)
    # Blocks kvgate believed cached that the engine did not have: the view was stale there.
    missed_blocks: int = 0
    # Blocks the engine had cached beyond kvgate's prediction: the view had forgotten them.
    extra_blocks: int = 0
    dropped_blocks: int = 0  # blocks removed from the view because of that (LRU inference)


def assess(
    instance_id: str,
    prompt_tokens: int,
    predicted_cached_tokens: int,
    engine_cached_tokens: int | None,
    engine_prompt_tokens: int | None,
    block_size: int,
) -> CacheFeedback:
    """Compare an engine's cached-token report with kvgate's prediction for one request."""
    if engine_cached_tokens is None or engine_cached_tokens < 0 or prompt_tokens <= 0:
        return CacheFeedback(instance_id, prompt_tokens, predicted_cached_tokens, None)
    scaled = bool(engine_prompt_tokens) and engine_prompt_tokens != prompt_tokens
    if scaled:
        assert engine_prompt_tokens is not None
        own = engine_cached_tokens * prompt_tokens // engine_prompt_tokens
    else:
        own = engine_cached_tokens
    own = min(own, prompt_tokens)
    # An engine computes at least a prompt's last token itself, so a fully cached prompt is
    # reported as prompt - 1 tokens: the prediction is capped the same way before the two
    # are compared in whole blocks. Scaled (approximate) counts may be a block off.
    predicted_blocks = min(predicted_cached_tokens, prompt_tokens - 1) // block_size
    slack = 1 if scaled else 0
    reported_blocks = own // block_size
    return CacheFeedback(
        instance_id,
        prompt_tokens,
        predicted_cached_tokens,
        own,
        missed_blocks=max(predicted_blocks - reported_blocks - slack, 0),
        extra_blocks=max(reported_blocks - predicted_blocks - slack, 0),
    )
