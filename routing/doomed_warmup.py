"""Doomed warm-up: prefill the prompt of a doomed request that was turned away.

A request is *doomed* when its prefill alone, on an idle instance, misses the TTFT SLO
(routing/best_effort.py). Best effort serves some of them late, when the fleet is idle enough
for their decode too; the rest are rejected, and rejecting one also dooms what comes after it:
the prefix it would have cached is never computed, so the next request sharing it (the
session's next turn, a retry, another user of the same document) is doomed in turn. On the
Mooncake synthetic trace with a 5 s TTFT SLO at 3x load, 507 of the 868 requests kvgate turned
away had a prefix the infinite cache of the goodput bound would have held but no request kvgate
admitted had computed (``python -m bench.bound_gap``; docs/experiments.md §2.3).

So when such a request is rejected on its TTFT and the prefill pool is idle enough, the
rejection carries a *warm-up* (``Rejection.warmup``): the same prompt, prefilled on an instance
with nothing booked, one token generated and dropped, no decode leg. It only takes capacity
nobody is using:

- its decode would have had room: the TBT it was checked at is within ``max_decode_load`` of
  its limit (its decode reservation taken off). Where decode binds, the longer contexts its
  prefix lets in would take the room of shorter ones (measured: −1 to −2 % on the 2023
  profile's decode-bound points without this);
- its instance has nothing booked (``nothing_booked``): no placed request waits behind it;
- at least ``min_idle`` of the prefill pool (all of it, where it is smaller) have nothing
  booked, itself included, so requests arriving during its long prefill have somewhere else
  to go;
- once dispatched (``Conductor.dispatched_warmup``) it is booked like any prefill, and the
  index records its blocks there as predicted, so the requests that share its prefix are
  placed behind it and counted as cached when it is done.

Of the idle instances the one that holds most of the prompt is warmed (least work), ties by
registration order. Only on engines that serve a plain request (vLLM, llama.cpp; an SGLang
prefill server needs its decode's bootstrap). The client is still told 429; its Retry-After is
when the warm-up should be done, after which a retry meets the SLO. Pure: the caller passes
``now``; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import replace

from routing.admission import Admission, EffectiveSLO
from routing.best_effort import doomed, nothing_booked
from routing.estimates import PrefillOption
from routing.policies.base import PlacementContext
from routing.types import Decision, Rejection, RejectReason, RequestInfo

WARMUP_SUFFIX = ":warmup"  # the warm-up's request id is the rejected request's plus this


def plan_warmup(
    ctx: PlacementContext,
    slo: EffectiveSLO,
    rejection: Rejection,
    option: PrefillOption,
    tbt_s: float,
    admission: Admission,
    policy: str,
) -> Rejection:
    """``rejection`` with the warm-up of the request's prompt when every condition above
    holds, else unchanged. ``option`` is the prefill option the TTFT check rejected, ``tbt_s``
    the TBT its decode was checked at."""
    req, settings = ctx.request, admission.settings
    s = settings.doomed_warmup
    if (
        not s.enabled
        or rejection.reason is not RejectReason.TTFT_SLO
        or not doomed(req, option, slo, settings)
        or tbt_s * settings.tbt_margin > s.max_decode_load * admission.tbt_limit_s(req, slo, tbt_s)
    ):
        return rejection
    pool = ctx.prefill_candidates
    idle = [inst for inst in pool if nothing_booked(inst, ctx.now)]
    if len(idle) < min(s.min_idle, len(pool)):
        return rejection
    plain = [inst for inst in idle if inst.serves_plain_requests]
    if not plain:
        return rejection
    # Least work first (the longest prefix held there); min() keeps the pool's order on ties.
    best = min((ctx.estimator.local(inst) for inst in plain), key=lambda o: o.ttft_s)
    warmup = Decision(
        request_id=req.request_id + WARMUP_SUFFIX,
        prefill=best.instance.id,
        decode=best.instance.id,
        predicted_ttft_s=best.ttft_s,
        predicted_tbt_s=0.0,
        predicted_queue_s=best.queue_s,
        predicted_prefill_s=best.prefill_s,
        predicted_transfer_s=0.0,
        predicted_load_s=best.load_s,
        predicted_output_tokens=1,
        cached_tokens=best.cached_tokens,
        prompt_tokens=req.prompt_tokens,
        policy=policy,
        reason="doomed_warmup",
        priority=slo.priority.name,
        slo_ttft_s=slo.ttft_s,
        slo_tbt_s=slo.tbt_s,
        warmup=True,
    )
    retry = min(max(best.ttft_s, settings.retry_after_min_s), settings.retry_after_max_s)
    return replace(rejection, warmup=warmup, retry_after_s=retry)


def warmup_request(req: RequestInfo, warmup: Decision) -> RequestInfo:
    """The request the warm-up sends: ``req``'s prompt, one token, no output-length key (its
    one token says nothing of the outputs that key predicts)."""
    return replace(req, request_id=warmup.request_id, max_tokens=1, output_key=None)
