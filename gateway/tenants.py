"""Tenants of the OpenAI endpoints: API keys, per-tenant rate limits, fair sharing.

Off by default (config ``tenants.enabled``). When on, for each request, in this order:

1. **Who** (``identify``, headers only, before the body is read): ``Authorization: Bearer
   <key>`` whose SHA-256 is a tenant's key; else, when ``tenants.header`` names one, that
   header (set by a trusted proxy in front) naming a configured tenant; else
   ``default_tenant`` unless ``require_key``. A wrong key is always 401 ``invalid_api_key``.
2. **Rate limits** (``admit``): the tenant's requests/s and prompt-tokens/s token buckets; a
   request that does not fit is 429 ``rate_limit_exceeded`` with Retry-After from the bucket.
3. **Fair share** (``screen``, on the Conductor's decision before it is booked): with SLO
   admission (``early``/``predictive``), a tenant over its weighted share of the recent
   demand (prompt + max_tokens of the requests it sent past its rate limits, decayed;
   routing/tenant_share.py) is admitted only if its predicted TTFT and TBT leave
   ``over_share_headroom`` of the SLO unused, the same mechanism as priority headroom. Under
   overload the over-share tenant's requests are shed while the queue is still below the
   SLO limit of the others, so their requests are neither late nor rejected first.

Keys (config and ``keys_file``) are read by the gateway at start-up and re-read on every
reload (SIGHUP or POST /admin/reload), off the event loop; a keys file that has gone bad
fails the reload and the running keys stay.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from config.settings import Settings
from config.tenant_keys import hash_key
from config.tenant_settings import TenantSettings, TenantsSettings
from gateway.answers import send_json
from gateway.openai import error_body
from routing.admission import SLO_MODES
from routing.tenant_share import FairShare, TokenBucket
from routing.types import Decision, Rejection, RejectReason, RequestInfo

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics
    from gateway.proxy_deps import ProxyGateway
    from gateway.relay import Send

log = logging.getLogger("kvgate.tenants")


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer given instead of serving the request (401/403/429)."""

    status: int
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()

    async def answer(self, send: Send, request_id: str) -> None:
        headers = [*self.headers, (b"x-request-id", request_id.encode())]
        await send_json(send, self.status, self.body, headers)


class TenantSeries:
    """One tenant's metric series, looked up once (``labels()`` costs ~1 us a call)."""

    __slots__ = ("_by_outcome", "_requests", "_tenant", "in_flight", "over_share", "prompt_tokens")

    def __init__(self, metrics: GatewayMetrics, tenant: str) -> None:
        self._tenant, self._requests = tenant, metrics.tenant_requests
        self._by_outcome: dict[str, Any] = {}
        self.in_flight = metrics.tenant_in_flight.labels(tenant)
        self.over_share = metrics.tenant_over_share.labels(tenant)
        self.prompt_tokens = metrics.tenant_prompt_tokens.labels(tenant)

    def requests(self, outcome: str) -> Any:
        child = self._by_outcome.get(outcome)
        if child is None:
            child = self._by_outcome[outcome] = self._requests.labels(self._tenant, outcome)
        return child


@dataclass(slots=True)
class TenantState:
    """One tenant's live state: its buckets, requests in flight, outcomes (for the admin)."""

    spec: TenantSettings
    series: TenantSeries
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0
    over_share_rejections: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, spec: TenantSettings, metrics: GatewayMetrics) -> TenantState:
        st = cls(spec, TenantSeries(metrics, spec.name))
        st.set_limits(spec)
        return st

    def set_limits(self, spec: TenantSettings) -> None:
        """New limits rebuild a bucket (full); unchanged ones keep their level."""
        old, self.spec = self.spec, spec
        if self.requests is None or (old.requests_per_s, old.burst_s) != (
            spec.requests_per_s,
            spec.burst_s,
        ):
            self.requests = _bucket(spec.requests_per_s, spec.burst_s)
        if self.tokens is None or (old.tokens_per_s, old.burst_s) != (
            spec.tokens_per_s,
            spec.burst_s,
        ):
            self.tokens = _bucket(spec.tokens_per_s, spec.burst_s)


def _bucket(rate: float | None, burst_s: float) -> TokenBucket | None:
    return None if rate is None else TokenBucket(rate, max(rate * burst_s, 1.0))


def _unauthorized(message: str) -> Refusal:
    body = error_body(message, "invalid_request_error", code="invalid_api_key")
    return Refusal(401, body, ((b"www-authenticate", b'Bearer realm="kvgate"'),))


class TenantGate:
    """The tenant hooks of one gateway's completion handler (all no-ops when off)."""

    def __init__(self, gw: ProxyGateway) -> None:
        self.gw = gw
        self.share = FairShare()
        self.states: dict[str, TenantState] = {}
        self._keys: dict[str, str] = {}  # key hash -> tenant
        self._weights: dict[str, float] = {}
        self._of: dict[str, str] = {}  # request id -> tenant, while it is served
        self._seen: Settings | None = None
        self.cfg = TenantsSettings()
        self._sync()

    # ------------------------------------------------------------------ settings
    @property
    def enabled(self) -> bool:
        self._sync()
        return self.cfg.enabled

    def _sync(self) -> None:
        settings = self.gw.settings
        if settings is self._seen:  # the hot path: one identity test
            return
        self._seen = settings
        self.apply(settings.tenants)

    def apply(self, cfg: TenantsSettings) -> None:
        """Take new tenant settings: keys, weights, limits (bucket levels kept if unchanged)."""
        # Read by the gateway at start-up and on reload (off the event loop), never here.
        self.cfg, self._keys = cfg, self.gw.tenant_keys
        self._weights = {t.name: t.weight for t in cfg.tenant}
        self.share.configure(cfg.share_half_life_s, cfg.active_window_s)
        fresh: dict[str, TenantState] = {}
        for spec in cfg.tenant:
            st = self.states.get(spec.name)
            if st is None:
                st = TenantState.build(spec, self.gw.metrics)
            else:
                st.set_limits(spec)
            fresh[spec.name] = st
        for gone in set(self.states) - set(fresh):
            self.share.forget(gone)
        self.states = fresh

    # ------------------------------------------------------------------ 1. who
    def identify(self, headers: dict[str, str]) -> str | Refusal:
        """The request's tenant ("" when tenants are off), or the answer refusing it."""
        self._sync()
        cfg = self.cfg
        if not cfg.enabled:
            return ""
        auth = headers.get("authorization")
        if auth is not None:
            scheme, _, key = auth.strip().partition(" ")
            tenant = self._keys.get(hash_key(key.strip())) if scheme.lower() == "bearer" else None
            if tenant is None:
                return self._refuse("unauthorized", _unauthorized("Incorrect API key provided."))
            return tenant
        if cfg.header is not None and (named := headers.get(cfg.header.lower())) is not None:
            if named in self.states:
                return named
            body = error_body(
                f"unknown tenant in header {cfg.header}",
                "invalid_request_error",
                code="unknown_tenant",
            )
            return self._refuse("unauthorized", Refusal(403, body))
        if not cfg.require_key and cfg.default_tenant is not None:
            return cfg.default_tenant
        return self._refuse(
            "unauthorized",
            _unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
            ),
        )

    def _refuse(self, outcome: str, refusal: Refusal, tenant: str = "") -> Refusal:
        self.gw.metrics.requests.labels(outcome).inc()
        if tenant:
            self.count(tenant, outcome)
        return refusal

    # ------------------------------------------------------------------ 2. limits
    def admit(self, tenant: str, request_id: str, info: RequestInfo, now: float) -> Refusal | None:
        """Rate limits; on success the request is booked to ``tenant`` until ``leave``."""
        st = self.states.get(tenant) if tenant else None
        if st is None:  # tenants off (or this one removed by a reload since ``identify``)
            return None
        waits = []
        if st.requests is not None:
            waits.append(("requests", st.requests.wait_s(1.0, now)))
        if st.tokens is not None:
            waits.append(("tokens", st.tokens.wait_s(float(info.prompt_tokens), now)))
        kind, wait = max(waits, key=lambda kw: kw[1], default=("", 0.0))
        if wait > 0:
            rate = st.spec.requests_per_s if kind == "requests" else st.spec.tokens_per_s
            unit = "requests" if kind == "requests" else "prompt tokens"
            body = error_body(
                f"Rate limit reached for tenant {tenant!r}: {rate:g} {unit} per second. "
                f"Try again in {wait:.2f} s.",
                kind,
                code="rate_limit_exceeded",
            )
            retry = str(max(1, math.ceil(wait))).encode()
            headers = ((b"retry-after", retry), (b"x-kvgate-reject-reason", b"tenant_rate_limit"))
            return self._refuse("rate_limited", Refusal(429, body, headers), tenant)
        if st.requests is not None:
            st.requests.take(1.0, now)
        if st.tokens is not None:
            st.tokens.take(float(info.prompt_tokens), now)
        if self.cfg.fair_share:  # its demand: what it asks for, served or not
            self.share.seen(tenant, now)
            self.share.used(tenant, float(info.prompt_tokens + info.max_tokens), now)
        self._of[request_id] = tenant
        st.in_flight += 1
        st.series.in_flight.set(st.in_flight)
        return None

    def leave(self, request_id: str) -> None:
        tenant = self._of.pop(request_id, None)
        st = self.states.get(tenant) if tenant else None
        if st is not None:
            st.in_flight -= 1
            st.series.in_flight.set(st.in_flight)

    # ------------------------------------------------------------------ 3. fair share
    def screen(self, d: Decision, info: RequestInfo, now: float) -> Decision | Rejection:
        """The decision, or a rejection when its tenant is over its share and the decision
        leaves less than ``over_share_headroom`` of the SLO unused. Called before the
        decision is booked; one turned away is withdrawn from the Conductor (its replication
        commands released, counted in its rejection stats)."""
        tenant = self._of.get(d.request_id)
        if tenant is None:
            return d
        st = self.states.get(tenant)
        if st is None:  # removed by a reload while this request was parsed
            return d
        # The prediction test first: it is cheaper and, off overload, passes.
        rejection = (
            self._over_share(tenant, d, info.model)
            if self.cfg.fair_share and self.gw.settings.admission.mode in SLO_MODES
            else None
        )
        if rejection is not None and self.share.over_share(tenant, 0.0, self._weights, now):
            # Counted by the Conductor as a rejection (admin, capacity signal), not a decision.
            self.gw.conductor.withdraw(d, rejection)
            st.series.over_share.inc()
            st.over_share_rejections += 1
            return rejection
        st.series.prompt_tokens.inc(info.prompt_tokens)
        return d

    def _over_share(self, tenant: str, d: Decision, model: str | None) -> Rejection | None:
        s = self.gw.settings
        keep = keep_tbt = 1.0 - self.cfg.over_share_headroom
        # A class removed by a reload since the decision: the tenant's headroom only.
        with contextlib.suppress(KeyError):
            cls = s.slo.priority(d.priority)
            keep *= 1.0 - cls.headroom
            # The configured TBT headroom, not the share admission learned to spend: a
            # tenant over its fair share is the one to keep it for the others.
            keep_tbt *= 1.0 - cls.tbt_keep
        adm = s.admission
        # The TTFT as admission checked it: its wait stretched by the learned wait margin.
        margin = self.gw.conductor.admission.wait_margin_for(model)
        ttft = margin.ttft(d.predicted_ttft_s, d.predicted_queue_s) * adm.ttft_margin
        # The TBT as admission checked it (forecast, or a colocated prefill's stall).
        checked = d.predicted_tbt_s if d.checked_tbt_s is None else d.checked_tbt_s
        tbt = checked * adm.tbt_margin
        checks = (
            (RejectReason.TTFT_SLO, "TTFT", ttft, keep * d.slo_ttft_s),
            (RejectReason.TBT_SLO, "TBT", tbt, keep_tbt * d.slo_tbt_s),
        )
        for reason, what, predicted, limit in checks:
            if predicted > limit:
                msg = (
                    f"predicted {what} {predicted * 1e3:.0f} ms exceeds tenant {tenant!r}'s"
                    f" limit {limit * 1e3:.0f} ms: the tenant is over its fair share and keeps"
                    f" {self.cfg.over_share_headroom:.0%} of the SLO for the others"
                )
                retry = min(max(predicted - limit, adm.retry_after_min_s), adm.retry_after_max_s)
                return Rejection(
                    d.request_id,
                    reason,
                    msg,
                    retry,
                    predicted_ttft_s=d.predicted_ttft_s,
                    predicted_tbt_s=d.predicted_tbt_s,
                    limit_s=limit,
                    priority=d.priority,
                )
        return None

    # ------------------------------------------------------------------ books
    def count(self, tenant_or_request: str, outcome: str) -> None:
        """Counts an outcome for a tenant (by name, or by a request id being served)."""
        tenant = self._of.get(tenant_or_request, tenant_or_request)
        st = self.states.get(tenant)
        if st is None:
            return
        st.outcomes[outcome] = st.outcomes.get(outcome, 0) + 1
        st.series.requests(outcome).inc()

    def view(self, now: float) -> dict[str, Any]:
        """GET /admin/tenants."""
        self._sync()
        cfg = self.cfg
        shares = self.share.shares(self._weights, now)
        tenants = []
        for name, st in self.states.items():
            share = shares.get(name)
            tenants.append(
                {
                    "name": name,
                    "weight": st.spec.weight,
                    "keys": sum(1 for t in self._keys.values() if t == name),
                    "requests_per_s": st.spec.requests_per_s,
                    "tokens_per_s": st.spec.tokens_per_s,
                    "in_flight": st.in_flight,
                    "active": share is not None,
                    "recent_demand_share": round(share[0], 4) if share else 0.0,
                    "weighted_share": round(share[1], 4) if share else None,
                    "over_share_rejections": st.over_share_rejections,
                    "outcomes": dict(st.outcomes),
                }
            )
        return {
            "enabled": cfg.enabled,
            "require_key": cfg.require_key,
            "header": cfg.header,
            "fair_share": cfg.fair_share,
            "over_share_headroom": cfg.over_share_headroom,
            "tenants": tenants,
        }
