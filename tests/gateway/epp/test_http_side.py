"""The picker's HTTP port (gateway/epp/http_side.py): /metrics, /books and the admin API as
`kvgate serve` has them. A live change through ``PUT /admin/slo`` is what the next pick
through Envoy's messages is judged by. Real Gateway and picker on loopback, no Envoy."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from config.settings import (
    Role,
    Settings,
)
from gateway.epp.exchange import Exchange
from gateway.epp.server import start_epp
from replay.emulator import EmulatorConfig, start_emulator
from tests.gateway.epp.messages import body_msg, colocated_gateway, request_headers_msg

TOKEN = "epp-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = json.dumps({"prompt": "word " * 400, "max_tokens": 2}).encode()


async def _pick(epp) -> int:
    """The pick's answer: 0 when placed, else the immediate status."""
    ex = Exchange(epp.picker)
    await ex.handle(request_headers_msg())
    out = await ex.handle(body_msg(BODY, True))
    ex.close()
    first = out[0]
    return first.immediate_response.status.code if first.HasField("immediate_response") else 0


def test_metrics_books_and_a_live_slo_change_through_the_admin_api() -> None:
    async def run():
        emu = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=0.05))
        server = replace(Settings().server, admin_token=TOKEN)
        gw = colocated_gateway(urls={"e0": emu.url}, server=server)
        epp = await start_epp(gw, port=0, metrics_port=0)
        url = f"http://127.0.0.1:{epp.metrics_port}"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(url + "/metrics") as r:
                    metrics = (r.status, await r.text())
                async with s.get(url + "/books") as r:
                    books = await r.json()
                async with s.get(url + "/admin/state") as r:
                    unauthorized = r.status
                before = await _pick(epp)
                async with s.put(url + "/admin/slo", json={"ttft_s": 0.001}, headers=AUTH) as r:
                    changed = (r.status, await r.json())
                # (a prompt too long for any SLO is otherwise served best effort when idle)
                off = {"best_effort": {"enabled": False}}
                async with s.put(url + "/admin/admission", json=off, headers=AUTH) as r:
                    assert r.status == 200, await r.text()
                after = await _pick(epp)
                async with s.get(url + "/admin/state", headers=AUTH) as r:
                    state = (r.status, await r.json())
        finally:
            await epp.stop(0)
            await emu.stop()
        return metrics, books, unauthorized, before, changed, after, state

    metrics, books, unauthorized, before, changed, after, state = asyncio.run(run())
    assert metrics[0] == 200 and "kvgate_requests_total" in metrics[1]
    assert books == {"requests": 0, "active": 0}
    assert unauthorized == 401
    assert before == 0  # placed under the default SLO
    assert changed[0] == 200 and changed[1]["ttft_s"] == 0.001
    assert after == 429  # the next pick is judged by the new SLO
    assert state[0] == 200 and "instances" in json.dumps(state[1])
