"""Tenants behind Envoy (gateway/epp/picker.py with gateway/tenants.py): an API key is
required and checked (401), a tenant's rate limit answers 429 before any decision, and a
placed request counts in its tenant's books until its answer ends. Real Gateway, Envoy's real
protobuf types, no Envoy."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from config.loader import settings_from_dict
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from gateway.runtime import Gateway
from gateway.tenants import hash_key
from tests.gateway.epp.messages import body_msg, request_headers_msg, set_headers_of

KEY = "sk-tenant-a"
BODY = json.dumps({"prompt": "hello " * 40, "max_tokens": 4}).encode()


def _gateway() -> Gateway:
    raw = {
        "admission": {"mode": "early"},
        "tenants": {
            "enabled": True,
            "tenant": [
                {
                    "name": "a",
                    "requests_per_s": 1.0,
                    "burst_s": 2.0,
                    "key_sha256": [hash_key(KEY)],
                }
            ],
        },
        "pools": [
            {
                "name": "w",
                "role": "both",
                "instances": [{"id": "w0", "url": "http://127.0.0.1:41001"}],
            }
        ],
    }
    return Gateway(settings_from_dict(raw, "tenants.toml"))


async def _pick(picker: Picker, auth: str | None, rid: str) -> tuple[Exchange, list]:
    ex = Exchange(picker)
    extra = {"x-request-id": rid, **({"authorization": auth} if auth else {})}
    await ex.handle(request_headers_msg(extra))
    return ex, await ex.handle(body_msg(BODY, True))


def test_a_missing_or_wrong_key_is_a_401_before_anything_is_parsed() -> None:
    async def run():
        picker = Picker(_gateway())
        return [(await _pick(picker, auth, "r"))[1] for auth in (None, "Bearer sk-nope")]

    for out in asyncio.run(run()):
        imm = out[0].immediate_response
        assert imm.status.code == 401
        assert json.loads(imm.body)["error"]["type"] == "invalid_request_error"
        assert set_headers_of(imm.headers)["x-request-id"] == "r"


def test_a_tenant_over_its_rate_is_a_429_and_placed_requests_count_until_they_end() -> None:
    async def run():
        gw = _gateway()
        picker = Picker(gw)
        placed = [await _pick(picker, f"Bearer {KEY}", f"r{i}") for i in range(2)]  # the burst
        _, third = await _pick(picker, f"Bearer {KEY}", "r2")
        in_flight = picker.tenants.states["a"].in_flight
        for ex, _ in placed:
            ex.close()  # the streams end (no answer): the books close
        return gw, picker, placed, third, in_flight

    gw, picker, placed, third, in_flight = asyncio.run(run())
    for _, out in placed:
        headers = set_headers_of(out[0].request_headers.response.header_mutation)
        assert headers["x-gateway-destination-endpoint"] == "127.0.0.1:41001"
    imm = third[0].immediate_response
    assert imm.status.code == 429
    headers = set_headers_of(imm.headers)
    assert headers["x-kvgate-reject-reason"] == "tenant_rate_limit"
    assert int(headers["retry-after"]) >= 1
    assert in_flight == 2
    st = picker.tenants.states["a"]
    assert st.in_flight == 0 and gw.conductor.requests == {} and gw.drain.active == 0
    assert st.outcomes.get("rate_limited") == 1
