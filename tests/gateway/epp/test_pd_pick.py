"""P/D pools behind Envoy at the message level (Envoy's real protobuf types, no Envoy): a P/D
pick goes to its decode instance's sidecar with the prefill engine in x-prefiller-host-port,
the fallbacks are the other decode sidecars, the served sidecar maps back to its decode
instance, and a client's own x-prefiller-host-port never reaches a sidecar."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from config.settings import InstanceSettings, PDProtocol, PoolSettings, Role, Settings
from gateway.epp import protocol as pr
from gateway.epp.cli import check_supported
from gateway.epp.envoy import endpoint_of
from gateway.epp.exchange import Exchange
from gateway.epp.pd_sidecar import PREFILLER_HEADER
from gateway.epp.picker import Picker
from gateway.runtime import Gateway
from tests.gateway.epp.messages import (
    body_msg,
    colocated_gateway,
    headers_msg,
    request_headers_msg,
    set_headers_of,
)

ENGINES = {"p0": 41101, "p1": 41102, "d0": 41201, "d1": 41202}
SIDECARS = {"d0": 41301, "d1": 41302}


def _pd_settings(sidecars: bool = True) -> Settings:
    def inst(iid: str, role: Role) -> InstanceSettings:
        side = SIDECARS.get(iid) if sidecars else None
        return InstanceSettings(
            id=iid,
            url=f"http://127.0.0.1:{ENGINES[iid]}",
            role=role,
            protocol=PDProtocol.VLLM,
            sidecar_url=f"http://127.0.0.1:{side}" if side else None,
        )

    pools = tuple(
        PoolSettings(r.value, r, tuple(inst(f"{r.value[0]}{i}", r) for i in range(2)))
        for r in (Role.PREFILL, Role.DECODE)
    )
    return Settings(pools=pools)


def _pick(gw: Gateway, extra: dict[str, str] | None = None):
    async def run():
        ex = Exchange(Picker(gw, fallbacks=1))
        await ex.handle(request_headers_msg(extra))
        body = json.dumps({"prompt": "tell me " * 40, "max_tokens": 3}).encode()
        out = await ex.handle(body_msg(body, True))
        return ex, out[0].request_headers.response.header_mutation

    return asyncio.run(run())


def test_a_pd_pick_goes_to_the_decode_sidecar_naming_the_prefill_engine() -> None:
    assert check_supported(_pd_settings()) is None
    gw = Gateway(_pd_settings())
    ex, mutation = _pick(gw)
    d = ex.flight.decision
    assert d.prefill in ("p0", "p1") and d.decode in ("d0", "d1")
    headers = set_headers_of(mutation)
    primary, fallback = headers[pr.DESTINATION_HEADER].split(",")
    assert primary == f"127.0.0.1:{SIDECARS[d.decode]}"  # the sidecar, not the engine
    other = ({"d0", "d1"} - {d.decode}).pop()
    assert fallback == f"127.0.0.1:{SIDECARS[other]}"  # another decode sidecar
    assert headers[PREFILLER_HEADER] == endpoint_of(f"http://127.0.0.1:{ENGINES[d.prefill]}")
    assert PREFILLER_HEADER not in mutation.remove_headers
    picker = ex.picker
    assert picker.addresses.instance_at(primary) == d.decode

    async def answer():  # the sidecar served: the pick's own route, no retry counted
        await ex.handle(
            ext.ProcessingRequest(
                response_headers=headers_msg({":status": "200", pr.SERVED_HEADER: primary})
            )
        )
        await ex.handle(body_msg(b'{"choices":[{"text":"ok"}]}', True, response=True))

    asyncio.run(answer())
    assert ex.flight.record.outcome == "completed" and not ex.flight.rebooked
    assert gw.metrics.retries._value.get() == 0
    assert gw.conductor.requests == {}


def test_a_clients_own_prefiller_header_is_removed_or_overwritten() -> None:
    bogus = {PREFILLER_HEADER: "10.9.9.9:1"}
    _, mutation = _pick(colocated_gateway(), bogus)
    assert PREFILLER_HEADER in mutation.remove_headers  # colocated: nobody's header
    assert PREFILLER_HEADER not in set_headers_of(mutation)
    ex, mutation = _pick(Gateway(_pd_settings()), bogus)
    prefill = ex.flight.decision.prefill
    assert set_headers_of(mutation)[PREFILLER_HEADER] == f"127.0.0.1:{ENGINES[prefill]}"


def test_pd_without_sidecars_is_refused_before_it_starts() -> None:
    why = check_supported(_pd_settings(sidecars=False))
    assert why is not None and "no sidecar_url" in why


def test_a_fallback_decode_sidecar_that_served_takes_the_decode_books() -> None:
    gw = Gateway(_pd_settings())
    ex, mutation = _pick(gw)
    planned = ex.flight.decision.decode
    _, fallback = set_headers_of(mutation)[pr.DESTINATION_HEADER].split(",")

    async def answer():  # the planned sidecar was unreachable: Envoy used the other one
        await ex.handle(
            ext.ProcessingRequest(
                response_headers=headers_msg({":status": "200", pr.SERVED_HEADER: fallback})
            )
        )
        moved = ex.flight.decision.decode
        assert ex.flight.request_id in gw.conductor.instances[moved].incoming
        await ex.handle(body_msg(b'{"choices":[{"text":"ok"}]}', True, response=True))
        return moved

    moved = asyncio.run(answer())
    assert moved != planned and ex.flight.rebooked and ex.flight.record.decode == moved
    assert gw.metrics.retries._value.get() == 1
    assert gw.conductor.requests == {}
