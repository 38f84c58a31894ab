"""Engines as Envoy names them: ``ip:port``, the pick's fallbacks, and back to an instance.

Envoy's override_host (and ORIGINAL_DST) route to an address, not a name, so each engine URL
is resolved once (at start, ``resolve_all``; a name that did not resolve then is tried again
when first picked) and remembered. Envoy reports the engine that served by the same address
(``x-gateway-destination-endpoint-served``), which ``instance_at`` maps back.

With P/D pools Envoy sends a request to its decode instance's sidecar (``sidecar_url``,
gateway/epp/pd_sidecar.py), which is that instance's ``route``; the prefill engine's own
address goes to the sidecar in a header. An instance without a sidecar is its own route.
"""

from __future__ import annotations

from gateway.epp.envoy import endpoint_of
from gateway.runtime import Gateway


class EngineAddresses:
    """The Gateway's engines by address; ``fallbacks`` addresses follow each pick."""

    def __init__(self, gw: Gateway, fallbacks: int = 1) -> None:
        if fallbacks < 0:
            raise ValueError("fallbacks must be >= 0")
        self.gw = gw
        self.fallbacks = fallbacks
        self._by_url: dict[str, str] = {}  # engine URL -> ip:port

    def _address(self, url: str) -> str:
        ep = self._by_url.get(url)
        if ep is None:
            ep = self._by_url[url] = endpoint_of(url)
        return ep

    def of(self, instance_id: str) -> str:
        """The engine's own address."""
        return self._address(self.gw.targets[instance_id].url)

    def route(self, instance_id: str) -> str:
        """Where Envoy sends the instance's requests: its sidecar if it has one."""
        spec = self.gw.specs.get(instance_id)
        sidecar = spec.sidecar_url if spec is not None else None
        return self._address(sidecar) if sidecar else self.of(instance_id)

    def resolve_all(self) -> list[str]:
        """Each engine's ``ip:port`` now (a host name resolves once, here at start rather than
        on a request's path); returns the instances whose name did not resolve yet."""
        failed = []
        for iid in list(self.gw.targets):
            try:
                self.of(iid)
                self.route(iid)
            except OSError:
                failed.append(iid)
        return failed

    def instance_at(self, endpoint: str) -> str | None:
        """The instance Envoy reached at ``endpoint`` (None: not one of ours, or never picked)."""
        specs = self.gw.specs
        for iid, target in self.gw.targets.items():
            spec = specs.get(iid)
            urls = (target.url, spec.sidecar_url) if spec is not None else (target.url,)
            if any(u and self._by_url.get(u) == endpoint for u in urls):
                return iid
        return None

    def for_pick(self, prefill: str, decode: str, model: str | None) -> list[str]:
        """Where Envoy sends the request, then the other eligible instances of its model that
        could take it instead, least queued first: Envoy tries them in order if the first
        cannot be reached (override_host). A P/D pick goes to its decode instance's route."""
        colocated = prefill == decode
        out = [self.route(decode)]
        if self.fallbacks == 0:
            return out
        gw, now = self.gw, self.gw.clock()
        others = [
            i
            for i in gw.conductor.instances.values()
            if i.id != decode
            and i.eligible
            and i.model == model
            and (i.does_prefill if colocated else i.does_decode and not i.does_prefill)
        ]
        if colocated:
            others.sort(key=lambda i: (i.queue_time(now), i.bit_order))
        else:  # decode instances: the smallest batch first
            others.sort(key=lambda i: (len(i.running) + len(i.incoming), i.bit_order))
        return out + [self.route(i.id) for i in others[: self.fallbacks]]
