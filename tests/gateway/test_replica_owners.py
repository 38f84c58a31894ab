"""Response owners over the replica exchange (gateway/replica_owners.py): the wire, the repeats,
and two ``kvgate`` replicas in front of two emulated engines that store their responses, where a
follow-up sent to the replica that did not relay its response still reaches its engine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import msgpack
import pytest

from config.loader import settings_from_dict
from config.settings import Role
from gateway.app import build_app
from gateway.replica_owners import (
    REPEATS,
    OwnerRelay,
    OwnersError,
    OwnersMessage,
    decode_owners,
    encode_owners,
)
from gateway.response_owners import ResponseOwners
from gateway.responses_api import response_id
from replay.emulator import EmulatorConfig, start_emulator
from tests.gateway.live import serving
from tests.real.engines import free_ports


def test_owners_round_trip_and_bad_payloads_are_refused() -> None:
    msg = OwnersMessage("A", (("resp_1", "e0"), ("resp_2", "e1")))
    assert decode_owners(encode_owners(msg)) == msg
    bad = [
        b"\xc1",
        msgpack.packb({"v": 2, "r": "A", "o": []}),
        msgpack.packb({"v": 1, "r": "", "o": []}),
        msgpack.packb({"v": 1, "r": "A", "o": {"resp_1": "e0"}}),
        msgpack.packb({"v": 1, "r": "A", "o": [["resp_1"]]}),
        msgpack.packb({"v": 1, "r": "A", "o": [["resp_1", 3]]}),
        msgpack.packb({"v": 1, "r": "A", "o": [["x" * 300, "e0"]]}),
    ]
    for payload in bad:
        with pytest.raises(OwnersError):
            decode_owners(payload)


def test_each_owner_goes_out_in_repeats_messages_then_stops() -> None:
    book = ResponseOwners(shared=True)
    relay = OwnerRelay(book, "A")
    assert relay.next_message() is None  # nothing learned: nothing sent
    book.remember("r1", "e0")
    first = decode_owners(relay.next_message() or b"")
    book.remember("r2", "e1")
    carried = [first.owners] + [
        decode_owners(relay.next_message() or b"").owners for _ in range(REPEATS)
    ]
    assert carried[0] == (("r1", "e0"),)
    assert sum(("r1", "e0") in c for c in carried) == REPEATS  # a dropped copy is covered
    assert sum(("r2", "e1") in c for c in carried) == REPEATS
    assert relay.next_message() is None and relay.sent == 2


def test_a_peers_owners_are_learned_and_its_own_ignored() -> None:
    mine, theirs = ResponseOwners(shared=True), ResponseOwners(shared=True)
    relay_a, relay_b = OwnerRelay(mine, "A"), OwnerRelay(theirs, "B")
    mine.remember("r1", "e0")
    payload = relay_a.next_message()
    assert payload is not None
    assert relay_a.receive(payload) is False  # its own, looped back
    assert relay_b.receive(payload) is True and theirs.owner("r1") == "e0"
    assert relay_b.receive(payload) is True and relay_b.learned == 1  # a repeat: not new
    assert relay_b.next_message() is None  # learned owners are not sent on


def _settings(engines: dict[str, str], bind: str, peer: str, replica: str) -> Any:
    return settings_from_dict(
        {
            "server": {"refit_interval_s": 0, "health_interval_s": 30.0},
            "replicas": {
                "enabled": True,
                "replica_id": replica,
                "bind": bind,
                "peers": [peer],
                "publish_interval_s": 0.05,
                "rotate_ties": False,  # ties go to each replica's first instance
            },
            "pools": [
                {
                    "name": "w",
                    "role": "both",
                    "instances": [{"id": i, "url": u} for i, u in engines.items()],
                }
            ],
        }
    )


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]):
    async with s.post(url + "/v1/responses", json=body) as r:
        return r.status, r.headers.get("x-kvgate-decode"), await r.read()


def test_a_follow_up_sent_to_another_replica_reaches_the_engine_that_holds_its_response() -> None:
    async def run() -> dict[str, Any]:
        engines = [
            await start_emulator(
                EmulatorConfig(
                    role=Role.BOTH,
                    port=0,
                    time_scale=0.05,
                    profile="llama3-8b-h100-tp1",
                    model="m",
                )
            )
            for _ in range(2)
        ]
        urls = {"e0": engines[0].url, "e1": engines[1].url}
        a_bind, b_bind = (f"tcp://127.0.0.1:{p}" for p in free_ports(2, lo=21000, hi=21100))
        # The same fleet listed in opposite orders: on an idle fleet (equal predictions) each
        # replica places on its first instance, so B on its own would not pick A's choice.
        app_a = build_app(_settings(dict(reversed(urls.items())), a_bind, b_bind, "A"))
        app_b = build_app(_settings(urls, b_bind, a_bind, "B"))
        out: dict[str, Any] = {}
        try:
            async with serving(app_a) as url_a, serving(app_b) as url_b:
                gw_a, gw_b = app_a.gateway, app_b.gateway
                async with aiohttp.ClientSession() as s:
                    deadline = time.monotonic() + 10
                    while "A" not in gw_b.replicas.peers or "B" not in gw_a.replicas.peers:
                        assert time.monotonic() < deadline, "the replicas never heard each other"
                        await asyncio.sleep(0.02)
                    status, owner, raw = await _post(s, url_a, {"model": "m", "input": "first"})
                    first = response_id(raw)
                    assert status == 200 and first is not None and owner is not None
                    t0 = time.monotonic()
                    while gw_b.response_owners.owner(first) != owner:
                        assert time.monotonic() - t0 < 5, "replica B never learned the owner"
                        await asyncio.sleep(0.005)
                    out["learned_after_s"] = time.monotonic() - t0
                    out["control"] = await _post(s, url_b, {"model": "m", "input": "unrelated"})
                    again = {"model": "m", "previous_response_id": first}
                    out["follow"] = [
                        await _post(s, url_b, {**again, "input": f"and {i}?"}) for i in range(4)
                    ]
                    out["owner"] = owner
                    out["metrics"] = gw_b.metrics.render().decode()
        finally:
            for e in engines:
                await e.stop()
        return out

    out = asyncio.run(asyncio.wait_for(run(), 90))
    assert out["learned_after_s"] < 1.0  # the next interval message, 50 ms later
    assert out["control"][0] == 200 and out["control"][1] != out["owner"]
    # Each engine keeps only its own responses: a follow-up anywhere else gets a 404.
    assert [(f[0], f[1]) for f in out["follow"]] == [(200, out["owner"])] * 4
    assert 'kvgate_replica_response_owners_total{direction="learned"} 1.0' in out["metrics"]
