"""Engines as Envoy names them: ``ip:port``, the pick's fallbacks, and back to an instance.

Envoy's override_host (and ORIGINAL_DST) route to an address, not a name, so each engine URL
is resolved once (at start, ``resolve_all``; a name that did not resolve then is tried again
when first picked) and remembered. Envoy reports the engine that served by the same address
(``x-gateway-destination-endpoint-served``), which ``instance_at`` maps back.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from gateway.runtime import Gateway


def endpoint_of(url: str) -> str:
    """``ip:port`` of an engine URL, as Envoy's ORIGINAL_DST / override_host want it (an IP,
    not a name: a host name is resolved here once). IPv6 in brackets."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ip = ipaddress.ip_address(info[0][4][0])
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class EngineAddresses:
    """The Gateway's engines by address; ``fallbacks`` addresses follow each pick."""

    def __init__(self, gw: Gateway, fallbacks: int = 1) -> None:
        if fallbacks < 0:
            raise ValueError("fallbacks must be >= 0")
        self.gw = gw
        self.fallbacks = fallbacks
        self._by_url: dict[str, str] = {}  # engine URL -> ip:port

    def of(self, instance_id: str) -> str:
        url = self.gw.targets[instance_id].url
        ep = self._by_url.get(url)
        if ep is None:
            ep = self._by_url[url] = endpoint_of(url)
        return ep

    def resolve_all(self) -> list[str]:
        """Each engine's ``ip:port`` now (a host name resolves once, here at start rather than
        on a request's path); returns the instances whose name did not resolve yet."""
        failed = []
        for iid in list(self.gw.targets):
            try:
                self.of(iid)
            except OSError:
                failed.append(iid)
        return failed

    def instance_at(self, endpoint: str) -> str | None:
        """The instance Envoy reached at ``endpoint`` (None: not one of ours, or never picked)."""
        targets = self.gw.targets
        return next((i for i in targets if self._by_url.get(targets[i].url) == endpoint), None)

    def for_pick(self, primary: str, model: str | None) -> list[str]:
        """The pick's address, then the other eligible instances of its model, least queued
        first: Envoy tries them in order if the pick cannot be reached (override_host)."""
        out = [self.of(primary)]
        if self.fallbacks == 0:
            return out
        gw, now = self.gw, self.gw.clock()
        others = [
            i
            for i in gw.conductor.instances.values()
            if i.id != primary and i.eligible and i.does_prefill and i.model == model
        ]
        others.sort(key=lambda i: (i.queue_time(now), i.bit_order))
        return out + [self.of(i.id) for i in others[: self.fallbacks]]
