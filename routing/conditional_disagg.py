"""Conditional disaggregation: prefill a request on its decode instance, with no KV transfer,
when the predictors say that serves it better (issue 11 item 6, ``routing.conditional_disagg``).

Peers decide by prompt size: llm-d's ``prefix-based-pd-decider`` disaggregates iff the tokens
not cached on the chosen decode pod reach ``nonCachedTokens``; Dynamo's conditional disagg
(``isl_bounding``) runs locally when the effective input is under 2048 tokens, or
(``prefill_load``) when the chosen prefill worker is busy. kvgate decides with its predictors
instead, so the threshold follows the hardware and the load:

- **TTFT**: local = the decode instance's own queued local prefills + the step in progress +
  the mixed step (the prefill plus one decode step of the batch); it must beat the
  disaggregated option's predicted TTFT (which includes the prefill pool's queue) and meet
  the TTFT limit.
- **TBT of the batch it joins**: the mixed step stalls every running sequence once, so it must
  itself fit the TBT limit: ``tbt_after + prefill <= limit`` (no token gap of the batch over
  the SLO). A first version let the stall be spread over each sequence's predicted remaining
  tokens (the mean-TBT view); with median output predictions the short outputs, which see the
  stall whole, then missed their TBT (conversation trace, 3x: 1.6 % of admitted, mean TBT of
  those 316 ms), so the per-step rule it is.

Decode instances keep no prefix-cache view (the KV index tracks prefill-capable instances), so
the local prefill computes the whole prompt: only short prompts qualify, and a prefix held by
the decode side is not credited (the simulated decode engines free a sequence's KV when it ends).
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.admission import EffectiveSLO
from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.types import RequestInfo

LOCAL_REASON = "decode_local"


@dataclass(slots=True)
class LocalPrefillOption(PrefillOption):
    """A prefill on the decode instance itself (``instance`` is the decode instance)."""

    @property
    def reason(self) -> str:
        return LOCAL_REASON


def local_prefill(
    req: RequestInfo,
    decode: InstanceState,
    remote: PrefillOption,
    slo: EffectiveSLO,
    now: float,
) -> LocalPrefillOption | None:
    """The local option on ``decode`` if it is predicted to serve ``req`` better than
    ``remote`` (the disaggregated choice) without breaking the batch's TBT; else None."""
    prefill_s = decode.predictors.prefill.predict(req.prompt_tokens, 0)
    step_s = decode.tbt_now()
    queue_s = decode.queue_time(now)
    # Worst case the step in progress must end first; the mixed step runs prefill + decode.
    ttft_s = queue_s + step_s + prefill_s + step_s
    if ttft_s >= remote.ttft_s or ttft_s > slo.ttft_limit_s:
        return None
    if decode.tbt_now(1, req.prompt_tokens) + prefill_s > slo.tbt_limit_s:
        return None
    return LocalPrefillOption(
        instance=decode,
        ttft_s=ttft_s,
        queue_s=queue_s,
        prefill_s=prefill_s,
        transfer_s=0.0,
        load_s=0.0,
        cached_blocks=0,
        cached_tokens=0,
    )
