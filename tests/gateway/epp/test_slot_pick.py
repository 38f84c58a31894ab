"""llama.cpp slot pinning behind Envoy at the message level (Envoy's real protobuf types, no
Envoy): a pick on a llama.cpp instance whose slots kvgate knows hands Envoy the body with
``id_slot`` (and its new length), in duplex and buffered mode; a repeat of a prefix goes to
the slot holding it; the pin is let go when the answer ends or the stream breaks; other
engines get the client's bytes unchanged."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

from config.settings import AdmissionMode
from gateway.epp import protocol as pr
from gateway.epp.cli import check_supported
from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from gateway.runtime import Gateway
from tests.gateway.epp.messages import (
    body_msg,
    colocated_gateway,
    headers_msg,
    request_headers_msg,
    set_headers_of,
)

URL = {"l0": "http://127.0.0.1:41501"}
PROMPT_A = "alpha beta gamma delta " * 40
PROMPT_B = "one two three four five " * 40


def _llama_gateway(slots: int = 2) -> Gateway:
    gw = colocated_gateway(AdmissionMode.NONE, URL)
    gw.slot_book.set_slots("l0", slots)  # what the /slots scrape tells it
    return gw


async def _pick(ex: Exchange, prompt: str, duplex: bool = True) -> tuple[bytes, dict[str, str]]:
    """The body Envoy is told to send the engine, and the pick's headers."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 2}).encode()
    await ex.handle(request_headers_msg(duplex=duplex))
    out = await ex.handle(body_msg(body, True))
    if not duplex:
        common = out[0].request_body.response
        sent = common.body_mutation.body if common.HasField("body_mutation") else body
        return sent, set_headers_of(common.header_mutation)
    head, *chunks = out
    pieces = [c.request_body.response.body_mutation.streamed_response.body for c in chunks]
    return b"".join(pieces), set_headers_of(head.request_headers.response.header_mutation)


async def _finish(ex: Exchange) -> None:
    """The engine answered (headers that end the stream): the books close."""
    answer = headers_msg({":status": "200"}, end=True)
    await ex.handle(ext.ProcessingRequest(response_headers=answer))


@pytest.mark.parametrize("duplex", [True, False], ids=["duplex", "buffered"])
def test_a_llama_pick_carries_id_slot_and_a_repeat_goes_to_the_same_slot(duplex: bool) -> None:
    async def run():
        gw = _llama_gateway()
        picker = Picker(gw, fallbacks=0)
        first = Exchange(picker)
        sent_a, headers = await _pick(first, PROMPT_A, duplex)
        await _finish(first)
        other = Exchange(picker)
        sent_b, _ = await _pick(other, PROMPT_B, duplex)  # A's slot idle: B takes the other
        await _finish(other)
        again = Exchange(picker)
        sent_a2, _ = await _pick(again, PROMPT_A + "and more", duplex)
        held = gw.slot_book.held
        again.close()  # the stream broke: the pin is let go too
        return gw, sent_a, headers, sent_b, sent_a2, held

    gw, sent_a, headers, sent_b, sent_a2, held = asyncio.run(run())
    a, b, a2 = json.loads(sent_a), json.loads(sent_b), json.loads(sent_a2)
    assert a["prompt"] == PROMPT_A and a["max_tokens"] == 2  # the client's request, plus:
    assert {a["id_slot"], b["id_slot"]} == {0, 1}
    assert a2["id_slot"] == a["id_slot"]  # the slot that holds A's prefix
    assert headers["content-length"] == str(len(sent_a))
    assert held == 1 and gw.slot_book.held == 0
    assert gw.conductor.requests == {}


def test_an_engine_without_known_slots_gets_the_clients_bytes() -> None:
    async def run():
        gw = colocated_gateway(AdmissionMode.NONE, URL)  # slots never reported
        ex = Exchange(Picker(gw, fallbacks=0))
        sent, headers = await _pick(ex, PROMPT_A)
        ex.close()
        return sent, headers

    sent, headers = asyncio.run(run())
    assert "id_slot" not in json.loads(sent) and "content-length" not in headers
    assert json.loads(sent)["prompt"] == PROMPT_A
    assert pr.DESTINATION_HEADER in headers


def test_slot_files_are_refused_behind_envoy(tmp_path) -> None:
    """A slot file is loaded before kvgate forwards a request; behind Envoy it does not."""
    s = _llama_gateway().settings
    assert check_supported(s) is None
    files = replace(s, routing=replace(s.routing, llamacpp_slot_save_path=str(tmp_path)))
    why = check_supported(files)
    assert why is not None and "llamacpp_slot_save_path" in why and "kvgate serve" in why
