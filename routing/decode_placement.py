"""Where a request's decode runs, and the TBT that admission checks for it.

Colocated pools decode where the prefill ran, and the TBT checked there is also the worst that
the request's prefill leaves to the decodes already there (routing/prefill_stall.py).
Otherwise the policy may choose; by default the instance with the lowest *committed* TBT
(everything assigned to it, including requests still in prefill) or, with
``decode_placement = "current"``, the lowest TBT of its running batch (Mooncake's), within KV
capacity and batch limits. Early admission checks today's TBT there; predictive admission the
TBT forecast for when the request arrives, never below today's (``predictive_tbt``). When the
prefill is done, ``rebind_target`` may move the decode to another instance if the chosen one
can no longer take it (late decode binding); with it on, predictive admission asks whether
any instance is forecast to take the request then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from config.settings import AdmissionMode, DecodePlacement
from routing.estimates import PrefillOption
from routing.instance_books import InstanceState
from routing.policies.base import PlacementContext, Policy
from routing.prefill_stall import stalled_tbt

_COMMITTED = attrgetter("committed_key")


def place_decode(
    ctx: PlacementContext,
    prefill: InstanceState,
    option: PrefillOption,
    policy: Policy,
    placement: DecodePlacement,
    mode: AdmissionMode,
    late_binding: bool = False,
    tbt_floor_s: float = 0.0,
    stall_credit: float | None = 0.0,
) -> tuple[InstanceState | None, float, float, float]:
    """Pick the decode instance; returns (instance, TBT now, TBT to check, retry hint).
    ``late_binding``: the decode may still move when the prefill is done; ``tbt_floor_s``:
    a TBT to check at or below it decides nothing (``Admission.tbt_floor_s``);
    ``stall_credit``: on a colocated instance, the share of its decodes' future slack that
    the stall of this prefill may spend (routing/stall_credit.py; 0: none of it; None: the
    stall is not checked)."""
    req = ctx.request
    need = req.prompt_tokens + ctx.predicted_output
    decode_pool = ctx.decode_candidates
    if not decode_pool:  # colocated: decode where the prefill ran
        tbt = prefill.tbt_now(1, req.prompt_tokens)
        check = tbt
        if ctx.slo is not None and stall_credit is not None:
            # Its prefill stalls the decodes already there (routing/prefill_stall.py).
            new_tokens = req.prompt_tokens - option.cached_tokens
            stalled = stalled_tbt(
                prefill,
                option,
                new_tokens,
                ctx.now,
                ctx.slo.tbt_s,
                stall_credit,
                # Only a request queued there uses it (a property chain: not on every decision).
                ctx.slo.tbt_limit_s if prefill.prefill_queue else None,
            )
            check = max(tbt, stalled)
        # Reported (x-kvgate-predicted-tbt-ms, the error reports): the TBT with the stalls of
        # the prefills that will run beside it, at the instance's recent prefill share. Not
        # checked: the stall checks of those prefills are what keep it within the SLO.
        expected = tbt * (1.0 + prefill.prefill_share(ctx.now))
        return prefill, expected, check, retry_hint(prefill, ctx.now)
    d = policy.select_decode(ctx)
    if d is None:
        # InstanceState.takes_decode, inlined: this runs for every decode instance on every
        # decision: the calls cost ~7 % of it (`kvgate bench decision` p50 37.5 vs 40.5 us).
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
    # Late binding chooses the decode instance again when the prefill is done: any that
    # takes the request then will do.
    pool = decode_pool if late_binding else ()
    return (
        d,
        tbt,
        predictive_tbt(d, ctx.now, option.ttft_s, req.prompt_tokens, tbt, pool, need, tbt_floor_s),
        retry_hint(d, ctx.now),
    )


def predictive_tbt(
    d: InstanceState,
    now: float,
    ttft_s: float,
    prompt_tokens: int,
    tbt_now: float,
    pool: Sequence[InstanceState] = (),
    need_tokens: int = 0,
    floor_s: float = 0.0,
) -> float:
    """The TBT predictive admission checks: the forecast for when the request reaches ``d``,
    but never below today's (``tbt_now``, what early admission checks).

    The forecast adds the requests already heading to ``d`` that get there first (a debit
    early admission cannot see) and takes off the running sequences predicted to finish by
    then (a credit). The credit is what made predictive lose to early (issue 11, measured in
    docs/experiments.md §2.3): (1) departures freed before the request arrives are claimed
    again by every request dispatched in between that arrives sooner (short prompts, cache
    hits), so the longer a request's own TTFT the more capacity it is promised twice; it
    biased admission toward long, uncached prompts (mean admitted prompt 9.6k vs 6.4k tokens)
    and wasted up to 5 % of prefills; (2) finish times come from a median output length on a
    heavy-tailed distribution, and admitting on a noisy forecast keeps exactly the requests
    whose forecast erred optimistically. So the credit may offset the debit but never take
    the check below today's load: predictive is at least as strict as early on the same
    instance and stricter exactly when requests already on their way will crowd it.
    ``pool``: with late decode binding, the decode instance is chosen again when the prefill
    is done (``rebind_target``), so the request needs *some* instance to take it then: the
    lowest forecast among ``d`` and the others in ``pool`` with room for ``need_tokens``,
    each never below its own today's TBT (the credit's reasons hold on every instance). Only
    ``d`` was forecast before late binding existed, as picking the best of several forecasts
    selects for the most optimistic error; now the rebind checks the instance again when the
    prefill is done and a wrong guess costs a wasted prefill, measured (docs/experiments.md
    §2.3, "Predictive admission with late binding": ≤ 0.60 % wasted). The others are looked
    at only while the best value is above both today's TBT and ``floor_s`` (below which the
    exact value decides nothing), and one already at or above it today is not forecast:
    forecasting every instance for every decision doubled `kvgate bench decision`'s p50."""
    at = now + ttft_s + d.predictors.link.time(prompt_tokens)
    fc = d.forecast(at, now, prompt_tokens).tbt_s
    enough = tbt_now if tbt_now > floor_s else floor_s
    for x in pool:
        if fc <= enough:
            break
        if x is d or not x.takes_decode(need_tokens):
            continue
        floor = x.tbt_now(1, prompt_tokens)  # the same rule as for d: no credit below it
        if floor >= fc:
            continue
        other = x.forecast(at, now, prompt_tokens).tbt_s
        if other < floor:
            other = floor
        if other < fc:
            fc = other
    return fc if fc > tbt_now else tbt_now


def tbt_fallback(
    ctx: PlacementContext, planned: InstanceState, passes: Callable[[float], bool]
) -> tuple[InstanceState, float, float, float] | None:
    """The decode instance to use instead of ``planned`` when the TBT check failed there:
    of the others with room whose TBT today with the request passes (``passes``), the one
    with the lowest committed load; returned as ``place_decode`` returns. None: there is
    none (the rejection stands).

    Placement by the lowest committed TBT balances where decodes will be, but the instance
    committed least can be today's busiest: a short prompt turned away there is an accident
    of placement, not a full decode pool. The caller asks only for prompts the decode
    reservation does not grade (``Admission.may_move_decode``): moving the long ones, the
    marginal and costly admissions at decode overload, cost up to 4 % goodput on the
    decode-bound conversation 2023 points. The check here is today's TBT in both admission
    modes: with late binding the decode is placed again when the prefill is done if the
    instance can no longer take it, and checking the forecast instead gained less (both in
    docs/experiments.md §2.3, "When the planned decode instance fails the TBT check").
    """
    req = ctx.request
    need = req.prompt_tokens + ctx.predicted_output
    best: tuple[float, int] | None = None
    found: tuple[InstanceState, float] | None = None
    for x in ctx.decode_candidates:
        if x is planned or not x.takes_decode(need):
            continue
        tbt = x.tbt_now(1, req.prompt_tokens)
        if not passes(tbt):
            continue
        key = (x.committed_key, x.bit_order)
        if best is None or key < best:
            best, found = key, (x, tbt)
    if found is None:
        return None
    x, tbt = found
    return x, tbt, tbt, retry_hint(x, ctx.now)


def rebind_target(
    planned: InstanceState,
    pool: list[InstanceState],
    prompt_tokens: int,
    need_tokens: int,
    tbt_limit_s: float,
) -> InstanceState | None:
    """Late decode binding, when a prefill finishes: the instance to move the decode to, or
    None to keep ``planned``. Only when ``planned`` can no longer take the request within the
    TBT SLO (today's batch with it; the engine's own join check sees the same): between
    admission and now others may have joined and predicted departures not happened. Then
    the one with the lowest TBT among those that take it within the SLO and hold its KV.
    Moving only on a predicted refusal, not to whichever is least loaded, keeps admission's
    books of where decodes go true: rebalancing every request at prefill completion admitted
    more and then wasted 2.3 % of prefills (docs/experiments.md §2.3)."""
    if planned.tbt_now(1, prompt_tokens) <= tbt_limit_s:
        return None
    best: tuple[float, int] | None = None
    target = None
    for x in pool:
        if x is planned or not x.eligible or not x.takes_decode(need_tokens):
            continue
        tbt = x.tbt_now(1, prompt_tokens)
        if tbt <= tbt_limit_s and (best is None or (tbt, x.bit_order) < best):
            best, target = (tbt, x.bit_order), x
    return target


def retry_hint(inst: InstanceState, now: float) -> float:
    nxt = inst.next_finish_s(now)
    return max(nxt - now, 0.0) if nxt is not None else 1.0
