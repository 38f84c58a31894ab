"""Admission: whether a placed request may run, decided before any GPU work.

- ``none``: admit everything (engines may still refuse later: "late rejection").
- ``early``: reject when the predicted TTFT or the chosen decode instance's *current* TBT
  (with the request added) breaks the SLO (Mooncake §4.2.6.1).
- ``predictive``: like early, but the decode TBT is forecast for the moment the request
  reaches decode (Mooncake §4.2.6.3), which damps the prefill/decode load oscillation; the
  forecast counts the requests already on their way there but is never taken below today's
  TBT by predicted departures (routing/decode_placement.py ``predictive_tbt`` says why).
- best effort (``admission.best_effort``, with early and predictive): a request that misses
  the TTFT SLO even on an idle instance may be served late when its instance and half the
  prefill pool are idle and decode has room (routing/best_effort.py).
- ``peer``: no SLO check; the overload control the placement policy's own system ships with
  (SMG limiter, GIE saturation detector, Dynamo busy thresholds:
  routing/policies/peer_overload.py), for comparing peers as they defend themselves.

Priority classes keep a ``headroom`` fraction of each SLO unused: a request is admitted
only if prediction <= (1 - headroom) * SLO, so lower classes are shed first. Under decode
overload the TBT limit of a long prompt also keeps a reserve for shorter ones
(``admission.decode_reservation``, routing/decode_reservation.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from config.errors import KvgateError
from config.settings import AdmissionMode, AdmissionSettings, PriorityClass, SLOSettings
from routing.decode_reservation import DecodeReservation
from routing.stall_credit import StallCreditControl
from routing.tbt_headroom import TBTHeadroomControl
from routing.types import Rejection, RejectReason, RequestInfo
from routing.wait_margin import WaitMarginControl

S = TypeVar("S")
T = TypeVar("T")


@dataclass(slots=True)  # per request: not frozen (see routing/types.py)
class EffectiveSLO:
    priority: PriorityClass
    ttft_s: float
    tbt_s: float
    tbt_share: float = 1.0  # of the class's TBT headroom in force (routing/tbt_headroom.py)

    @property
    def tbt_keep(self) -> float:
        return self.priority.tbt_keep * self.tbt_share

    @property
    def ttft_limit_s(self) -> float:
        return self.ttft_s * (1.0 - self.priority.headroom)

    @property
    def tbt_limit_s(self) -> float:
        return self.tbt_s * (1.0 - self.tbt_keep)


def _for_model(
    table: dict[str | None, T], model: str | None, make: Callable[[S], T], settings: S
) -> T:
    """The served model's own state in ``table``, made from ``settings`` on first use."""
    state = table.get(model)
    if state is None:
        state = table[model] = make(settings)
    return state


def _clamp(v: float, lo: float, hi: float) -> float:
    return lo if v < lo else hi if v > hi else v


# The modes that judge a request against its SLOs (``none`` and ``peer`` never do).
SLO_MODES = frozenset({AdmissionMode.EARLY, AdmissionMode.PREDICTIVE})


class UnknownPriority(KvgateError, ValueError):
    pass


def resolve_slo(req: RequestInfo, slo: SLOSettings) -> EffectiveSLO:
    """Global SLO, overridden by the priority class, then by the request within limits."""
    name = req.priority or slo.default_priority
    try:
        cls = slo.priority(name)
    except KeyError:
        known = ", ".join(p.name for p in slo.priorities)
        raise UnknownPriority(f"unknown priority {name!r} (known: {known})") from None
    ttft = cls.ttft_s if cls.ttft_s is not None else slo.ttft_s
    tbt = cls.tbt_s if cls.tbt_s is not None else slo.tbt_s
    if req.slo_ttft_s is not None:
        ttft = _clamp(req.slo_ttft_s, slo.min_ttft_s, slo.max_ttft_s)
    if req.slo_tbt_s is not None:
        tbt = _clamp(req.slo_tbt_s, slo.min_tbt_s, slo.max_tbt_s)
    return EffectiveSLO(cls, ttft, tbt)


class Admission:
    __slots__ = (
        "_floor_share",
        "_peer",
        "_peer_policy",
        "reservations",
        "settings",
        "stall_credits",
        "tbt_headroom",
        "wait_margins",
    )

    def __init__(self, settings: AdmissionSettings) -> None:
        self.settings = settings
        # tbt_floor_s: every TBT comparison below has its threshold at or above this share
        # of the limit (the plain limit, the limit less the decode reservation's largest
        # reserve, best effort's max_decode_load).
        share = 1.0
        if settings.decode_reservation.enabled:
            share = 1.0 - settings.decode_reservation.fraction
        if settings.best_effort.enabled:
            share = min(share, settings.best_effort.max_decode_load)
        self._floor_share = share / settings.tbt_margin
        # One per served model: each model's pools, prompt lengths and overload are its own.
        self.reservations: dict[str | None, DecodeReservation] = {}
        self.tbt_headroom: dict[str | None, TBTHeadroomControl] = {}
        self.wait_margins: dict[str | None, WaitMarginControl] = {}
        self.stall_credits: dict[str | None, StallCreditControl] = {}
        self._peer: Any = None  # the peer's overload control, built for the policy in use
        self._peer_policy: object = None

    def check_peer(self, policy: object, ctx: Any, seed: int = 0) -> Rejection | None:
        """Admission mode ``peer``: ask the overload control of ``policy``'s system.

        ``ctx`` is the request's PlacementContext. The control keeps state (SMG's token
        bucket, GIE's metric scrapes), so it is rebuilt only when the policy object changes."""
        from routing.policies.peer_overload import build_peer_overload, peer_rejection

        if self._peer is None or self._peer_policy is not policy:
            self._peer = build_peer_overload(policy, self.settings.peer, seed)
            self._peer_policy = policy
        verdict = self._peer.check(ctx)
        if verdict is None:
            return None
        priority = ctx.slo.priority.name if ctx.slo is not None else None
        return peer_rejection(ctx, verdict, priority)

    @property
    def mode(self) -> AdmissionMode:
        return self.settings.mode

    def check(
        self,
        req: RequestInfo,
        slo: EffectiveSLO,
        ttft_s: float,
        tbt_s: float,
        tbt_retry_s: float,
        ttft_promised: bool = True,
        retry: bool = False,
        wait_s: float = 0.0,
    ) -> Rejection | None:
        """``tbt_s`` is the current TBT for ``early`` and the forecast for ``predictive``.
        ``ttft_promised=False``: a best-effort admission (routing/best_effort.py), judged on
        the TBT only. ``retry``: the request was checked before (placed again after a failed
        instance); the reservation's windows count it once. ``wait_s``: the queue wait in
        ``ttft_s``, stretched by the learned wait margin (routing/wait_margin.py)."""
        s = self.settings
        if s.mode not in SLO_MODES:
            return None
        ttft = self.wait_margin_for(req.model).ttft(ttft_s, wait_s) if wait_s > 0.0 else ttft_s
        ttft_pred, tbt_pred = ttft * s.ttft_margin, tbt_s * s.tbt_margin
        plain_fails = tbt_pred > slo.tbt_limit_s
        reservation = _for_model(
            self.reservations, req.model, DecodeReservation, s.decode_reservation
        )
        reserve = reservation.reserve(req.prompt_tokens, plain_fails, count=not retry)
        rejection = None
        ttft_limit, tbt_limit = slo.ttft_limit_s, slo.tbt_limit_s * (1.0 - reserve)
        predicted = (ttft_s, tbt_s)
        if ttft_promised and ttft_pred > ttft_limit:
            over = ttft_pred - ttft_limit
            rejection = self._rejection(
                req, slo, RejectReason.TTFT_SLO, ttft_pred, ttft_limit, over, predicted
            )
        elif tbt_pred > tbt_limit:
            rejection = self._rejection(
                req, slo, RejectReason.TBT_SLO, tbt_pred, tbt_limit, tbt_retry_s, predicted, reserve
            )
            reservation.turned_away += not plain_fails
        # Every request checked counts in the reservation's windows, even one the TTFT fails.
        if not retry:
            reservation.record(req.prompt_tokens, rejection is None)
        return rejection

    def tbt_limit_s(self, req: RequestInfo, slo: EffectiveSLO, tbt_s: float) -> float:
        """The TBT limit ``req``'s decode is checked against when ``tbt_s`` is its TBT, its
        decode reservation taken off (as ``check`` would; nothing is counted)."""
        reservation = self.reservations.get(req.model)
        if reservation is None:
            return slo.tbt_limit_s
        plain_fails = tbt_s * self.settings.tbt_margin > slo.tbt_limit_s
        return slo.tbt_limit_s * (1.0 - reservation.reserve(req.prompt_tokens, plain_fails, False))

    def tbt_passes(self, req: RequestInfo, slo: EffectiveSLO, tbt_s: float) -> bool:
        """Whether ``check`` would let ``req``'s decode in at ``tbt_s`` (always outside the
        SLO modes); nothing is counted."""
        s = self.settings
        if s.mode not in SLO_MODES:
            return True
        tbt, limit = tbt_s * s.tbt_margin, slo.tbt_limit_s
        # The reservation takes at most ``fraction`` of the limit: decide without it when it
        # cannot matter (this runs for every decision; ranking the prompt costs ~5 % of one).
        if tbt > limit:
            return False
        if not s.decode_reservation.enabled or tbt <= limit * (1.0 - s.decode_reservation.fraction):
            return True
        return tbt <= self.tbt_limit_s(req, slo, tbt_s)

    def may_move_decode(self, req: RequestInfo) -> bool:
        """Whether a decode that fails the TBT check on its planned instance may go to another
        that passes it: only a prompt the decode reservation never grades (at or below its
        ``from_quantile`` rank), which fails on a planned instance by accident of placement;
        a longer one failing is the marginal, costly admission the reservation is for."""
        s = self.settings.decode_reservation
        reservation = self.reservations.get(req.model)
        if not s.enabled or reservation is None:
            return True
        return reservation.prompts.rank(req.prompt_tokens) <= s.from_quantile

    def tbt_floor_s(self, slo: EffectiveSLO) -> float:
        """The TBT at or below which no admission decision turns on its exact value."""
        return slo.tbt_limit_s * self._floor_share

    def headroom_for(self, model: str | None) -> TBTHeadroomControl:
        settings = self.settings.tbt_headroom
        return _for_model(self.tbt_headroom, model, TBTHeadroomControl, settings)

    def observe_decode(
        self, model: str | None, missed: bool, stall_missed: bool | None = None
    ) -> None:
        """A decode this admission let in finished (``missed``: over its TBT SLO) or was
        refused by its engine (missed); only the SLO modes learn from it. ``stall_missed``:
        for a decode that ran beside the prefills the stall check let in (colocated), whether
        it missed because of them; a miss they did not make is not the check's to learn from
        (an engine stalled by its host, an output much longer than predicted)."""
        if self.settings.mode in SLO_MODES:
            self.headroom_for(model).observe(missed)
            if stall_missed is not None and self.settings.prefill_stall.enabled:
                self.stall_credit_for(model).observe(stall_missed)

    def stall_credit_for(self, model: str | None) -> StallCreditControl:
        settings = self.settings.prefill_stall
        return _for_model(self.stall_credits, model, StallCreditControl.start, settings)

    def stall_credit(self, model: str | None) -> float | None:
        """The credit the colocated prefill-stall check counts on for ``model``; None when
        the check is off (disabled, or a mode that checks no SLO)."""
        if not self.settings.prefill_stall.enabled or self.settings.mode not in SLO_MODES:
            return None
        return self.stall_credit_for(model).credit

    def wait_margin_for(self, model: str | None) -> WaitMarginControl:
        return _for_model(self.wait_margins, model, WaitMarginControl, self.settings.wait_margin)

    def observe_first_token(self, model: str | None, missed: bool) -> None:
        """A request this admission let in with the TTFT promise got its first token
        (``missed``: after its TTFT SLO); only the SLO modes learn from it."""
        if self.settings.mode in SLO_MODES:
            self.wait_margin_for(model).observe(missed)

    @property
    def turned_away_by_reserve(self) -> int:
        """Rejections the decode reservation made that the plain TBT check would have admitted."""
        return sum(r.turned_away for r in self.reservations.values())

    def _rejection(
        self,
        req: RequestInfo,
        slo: EffectiveSLO,
        reason: RejectReason,
        predicted: float,
        limit: float,
        retry_s: float,
        predictions: tuple[float, float],  # (TTFT, TBT) as predicted, before the margins
        reserve: float = 0.0,
    ) -> Rejection:
        what = "TTFT" if reason is RejectReason.TTFT_SLO else "TBT"
        return Rejection(
            req.request_id,
            reason,
            _message(what, predicted, limit, slo, reserve),
            self._retry(retry_s),
            predicted_ttft_s=predictions[0],
            predicted_tbt_s=predictions[1],
            limit_s=limit,
            priority=slo.priority.name,
        )

    def _retry(self, seconds: float) -> float:
        return _clamp(seconds, self.settings.retry_after_min_s, self.settings.retry_after_max_s)


def _message(
    what: str, predicted: float, limit: float, slo: EffectiveSLO, reserve: float = 0.0
) -> str:
    extra = ""
    keep = slo.priority.headroom if what == "TTFT" else slo.tbt_keep
    if keep > 0:
        extra = (
            f" ({slo.priority.name} priority keeps {keep:.0%} headroom"
            f" of the {(slo.ttft_s if what == 'TTFT' else slo.tbt_s) * 1000:.0f} ms SLO)"
        )
    if reserve > 0:
        extra += f"; under decode overload {reserve:.0%} of it is kept for shorter prompts"
    return (
        f"predicted {what} {predicted * 1000:.0f} ms exceeds the {what} SLO limit"
        f" {limit * 1000:.0f} ms{extra}"
    )


def unavailable_rejection(
    req: RequestInfo, reason: RejectReason, slo: EffectiveSLO, retry_after_s: float
) -> Rejection:
    """No healthy instance of a pool the request needs (503, not the request's fault)."""
    pool = "prefill" if reason is RejectReason.NO_HEALTHY_PREFILL else "decode"
    return Rejection(
        req.request_id,
        reason,
        f"no healthy {pool} instance is available",
        retry_after_s,
        priority=slo.priority.name,
        no_capacity=True,
    )


def capacity_rejection(
    req: RequestInfo, slo: EffectiveSLO, predicted_ttft_s: float, retry_after_s: float
) -> Rejection:
    """No decode instance can hold the prompt and its predicted output."""
    return Rejection(
        req.request_id,
        RejectReason.KV_CAPACITY,
        "no decode instance has KV cache room for the prompt and its predicted output",
        retry_after_s,
        predicted_ttft_s=predicted_ttft_s,
        priority=slo.priority.name,
    )
