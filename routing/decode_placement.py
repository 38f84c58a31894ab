"""Where a request's decode runs, and the TBT that admission checks for it.

Colocated pools decode where the prefill ran. Otherwise the policy may choose; by default the
instance with the lowest *committed* TBT (everything assigned to it, including requests still in
prefill) or, with ``decode_placement = "current"``, the lowest TBT of its running batch
(Mooncake's), within KV capacity and batch limits. Early admission checks today's TBT there;
predictive admission the TBT forecast for when the request arrives.
"""

from __future__ import annotations

from operator import attrgetter

from config.settings import AdmissionMode, DecodePlacement
from routing.cluster import InstanceState
from routing.estimates import PrefillOption
from routing.policies.base import PlacementContext, Policy

_COMMITTED = attrgetter("committed_key")


def place_decode(
    ctx: PlacementContext,
    prefill: InstanceState,
    option: PrefillOption,
    policy: Policy,
    placement: DecodePlacement,
    mode: AdmissionMode,
) -> tuple[InstanceState | None, float, float, float]:
    """Pick the decode instance; returns (instance, TBT now, TBT to check, retry hint)."""
    req = ctx.request
    need = req.prompt_tokens + ctx.predicted_output
    decode_pool = ctx.decode_candidates
    if not decode_pool:  # colocated: decode where the prefill ran
        tbt = prefill.tbt_now(1, req.prompt_tokens)
        return prefill, tbt, tbt, retry_hint(prefill, ctx.now)
    d = policy.select_decode(ctx)
    if d is None:
        fits = [
            x
            for x in decode_pool
            if x.reserved_tokens + need <= x.capacity_tokens and x.batch < x.max_batch
        ]
        if fits:
            p = req.prompt_tokens

            def current(x: InstanceState) -> tuple[float, int]:
                return (x.tbt_now(1, p), x.bit_order)

            d = min(fits, key=_COMMITTED if placement is DecodePlacement.COMMITTED else current)
        elif mode is not AdmissionMode.NONE:
            return None, 0.0, 0.0, 0.0
        else:
            d = decode_pool[0]  # no admission: place it anyway, on the first
    tbt = d.tbt_now(1, req.prompt_tokens)
    if mode is not AdmissionMode.PREDICTIVE:
        return d, tbt, tbt, retry_hint(d, ctx.now)  # early: today's load
    # Predictive: the load forecast for when the request gets there. The instance is the
    # committed-load choice; picking the best of several forecasts would select for the
    # most optimistic forecast error (more late rejections), so only one is forecast.
    at = ctx.now + option.ttft_s + d.predictors.link.time(req.prompt_tokens)
    fc = d.forecast(at, ctx.now, req.prompt_tokens).tbt_s
    return d, tbt, fc, retry_hint(d, ctx.now)


def retry_hint(inst: InstanceState, now: float) -> float:
    nxt = inst.next_finish_s(now)
    return max(nxt - now, 0.0) if nxt is not None else 1.0
