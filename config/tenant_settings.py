"""The typed ``[tenants]`` section: tenants of the OpenAI endpoints, their keys and limits
(checked in config/tenant_checks.py, keys read by config/tenant_keys.py, enforced by
gateway/tenants.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """One tenant: its weight in fair sharing, its rate limits and its API keys (hashes)."""

    name: str
    weight: float = 1.0  # share of contended capacity = weight / sum(active tenants' weights)
    requests_per_s: float | None = None  # None = no limit
    tokens_per_s: float | None = None  # prompt tokens (as kvgate counts them); None = no limit
    burst_s: float = 1.0  # each bucket holds this many seconds of its rate (at least 1)
    # SHA-256 hex of each API key (``printf '%s' "$KEY" | sha256sum``); never the key itself.
    key_sha256: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TenantsSettings:
    """Tenants of the OpenAI endpoints (off by default; gateway/tenants.py)."""

    enabled: bool = False
    # Every request must carry ``Authorization: Bearer <key>`` of a tenant (else 401).
    require_key: bool = True
    keys_file: str | None = None  # more keys, one "TENANT SHA256HEX" a line (reloadable)
    # A header naming the tenant, set by a trusted proxy in front; honoured only when set here
    # and only for requests without a key.
    header: str | None = None
    default_tenant: str | None = None  # require_key = false: requests with no key nor header
    # Under contention a tenant over its weighted share is admitted only with this fraction
    # of each SLO left unused, so it is shed before a tenant within its share.
    fair_share: bool = True
    over_share_headroom: float = 0.5
    share_half_life_s: float = 5.0  # a tenant's recent demand decays with this half-life
    active_window_s: float = 10.0  # a tenant is active this long after its last request
    tenant: tuple[TenantSettings, ...] = ()

    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenant)
