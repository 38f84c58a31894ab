"""Validation of the ``[tenants]`` section (keys, weights, limits; docs/reliability.md,
"Tenants"), called from config/checks.py."""

from __future__ import annotations

from typing import Any

from config.checker import Checker
from config.tenant_keys import KeyFileError, is_key_hash, read_key_file
from config.tenant_settings import TenantsSettings


def check_tenants(c: Checker, t: TenantsSettings) -> None:
    key = "tenants."
    names: dict[Any, str] = {}
    hashes: dict[Any, str] = {}
    for i, ten in enumerate(t.tenant):
        tk = f"tenants.tenant[{i}]"
        c.non_empty(f"{tk}.name", ten.name)
        c.require(" " not in ten.name, f"{tk}.name", ten.name, "must not contain spaces")
        c.unique(f"{tk}.name", ten.name, names, "tenant name")
        c.positive(f"{tk}.weight", ten.weight)
        c.positive(f"{tk}.requests_per_s", ten.requests_per_s)
        c.positive(f"{tk}.tokens_per_s", ten.tokens_per_s)
        c.positive(f"{tk}.burst_s", ten.burst_s)
        for j, digest in enumerate(ten.key_sha256):
            hk = f"{tk}.key_sha256[{j}]"
            ok = is_key_hash(digest.lower())
            # Not echoed: a key pasted here by mistake must not reach the logs.
            c.require(ok, hk, "***", "must be a SHA-256 hash (64 hex digits), not the key")
            if ok:
                c.unique(hk, digest, hashes, "API key", digest.lower())
    c.fraction(key + "over_share_headroom", t.over_share_headroom)
    c.positive(key + "share_half_life_s", t.share_half_life_s)
    c.positive(key + "active_window_s", t.active_window_s)
    if t.header is not None:
        token = t.header.strip().lower()
        c.require(
            bool(token) and token.isascii() and all(ch.isalnum() or ch in "-_" for ch in token),
            key + "header",
            t.header,
            "must be an HTTP header name (letters, digits, '-')",
        )
        c.require(token != "authorization", key + "header", t.header, "must not be Authorization")
    if t.default_tenant is not None:
        c.require(
            t.default_tenant in names,
            key + "default_tenant",
            t.default_tenant,
            f"must name a tenant (tenants: {', '.join(names) or 'none defined'})",
        )
    if t.keys_file is not None:
        try:
            read_key_file(t.keys_file, set(names))
        except KeyFileError as exc:
            c.require(False, key + "keys_file", t.keys_file, str(exc))
    if not t.enabled:
        return
    c.require(bool(t.tenant), key + "tenant", [], "enabled tenants need at least one tenant")
    has_keys = t.keys_file is not None or any(ten.key_sha256 for ten in t.tenant)
    if t.require_key:
        c.require(has_keys, key + "require_key", True, "needs key_sha256 or a keys_file")
    else:
        c.require(
            t.header is not None or t.default_tenant is not None,
            key + "require_key",
            False,
            "without keys, requests need a tenant: set header or default_tenant",
        )
