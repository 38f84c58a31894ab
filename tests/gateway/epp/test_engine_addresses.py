"""Engines as Envoy names them (gateway/epp/engine_addresses.py): ``ip:port`` from a URL, the
pick's fallbacks (eligible, same model, least queued first) and the address Envoy reports
mapped back to the instance. Real Gateway (not started)."""

from __future__ import annotations

import pytest

from gateway.epp.engine_addresses import EngineAddresses
from gateway.epp.envoy import endpoint_of
from tests.gateway.epp.messages import URLS, colocated_gateway


def test_endpoint_of_gives_ip_and_port() -> None:
    assert endpoint_of("http://10.1.2.3:8000/") == "10.1.2.3:8000"
    assert endpoint_of("http://localhost:41003") in ("127.0.0.1:41003", "[::1]:41003")
    assert endpoint_of("http://[::1]:9000") == "[::1]:9000"
    assert endpoint_of("https://10.0.0.1") == "10.0.0.1:443"


def test_the_pick_comes_first_then_the_least_queued_eligible_others() -> None:
    gw = colocated_gateway()
    now = gw.clock()
    gw.conductor.instances["b"].enqueue_prefill("busy", 60.0, 1024, now, now)
    addresses = EngineAddresses(gw, fallbacks=2)
    assert addresses.resolve_all() == []
    assert addresses.for_pick("a", "a", None) == [
        endpoint_of(URLS["a"]),
        endpoint_of(URLS["c"]),  # idle
        endpoint_of(URLS["b"]),  # a minute of queued prefill
    ]
    gw.conductor.drain_instance("c")
    assert addresses.for_pick("a", "a", None) == [endpoint_of(URLS["a"]), endpoint_of(URLS["b"])]
    assert EngineAddresses(gw, fallbacks=0).for_pick("a", "a", None) == [endpoint_of(URLS["a"])]
    with pytest.raises(ValueError):
        EngineAddresses(gw, fallbacks=-1)


def test_the_address_envoy_reports_maps_back_to_its_instance() -> None:
    gw = colocated_gateway()
    addresses = EngineAddresses(gw)
    assert addresses.instance_at(endpoint_of(URLS["b"])) is None  # never resolved yet
    addresses.resolve_all()
    assert {addresses.instance_at(endpoint_of(u)) for u in URLS.values()} == set(URLS)
    assert addresses.instance_at("10.9.9.9:1") is None
