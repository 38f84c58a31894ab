"""Protocol drivers against a recording stub engine: the exact fields each leg receives."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends.drivers import (
    ColocatedDriver,
    ForwardPlan,
    SGLangDriver,
    Target,
    UpstreamError,
    VLLMDriver,
    driver_for,
)
from config.settings import KVConnector, PDProtocol

KV_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "eng-1",
    "remote_request_id": "rid-1",
    "remote_host": "127.0.0.1",
    "remote_port": 1234,
    "tp_size": 1,
}
SSE = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\ndata: [DONE]\n\n'


class StubEngine:
    """Records every request; answers as a P/D engine would."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.seen: list[tuple[str, Any, dict[str, Any]]] = []
        self.decode_arrived = asyncio.Event()
        self.fail_with: int | None = None
        self.params: dict[str, Any] | None = KV_PARAMS  # what a prefill answers with
        self.delay_s = 0.0  # before answering
        self.server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, request.headers.copy(), body))
        if self.fail_with:
            return web.json_response({"error": {"message": "boom"}}, status=self.fail_with)
        await asyncio.sleep(self.delay_s)
        if self.role == "prefill":
            if "bootstrap_room" in body:  # SGLang: the prefill waits for its decode partner
                await asyncio.wait_for(self.partner.decode_arrived.wait(), 5)
            answer: dict[str, Any] = {"choices": [{"text": "x"}]}
            if self.params is not None:
                answer["kv_transfer_params"] = self.params
            return web.json_response(answer)
        self.decode_arrived.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE)
        await resp.write_eof()
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")


async def _pair():
    p, d = StubEngine("prefill"), StubEngine("decode")
    p.partner = d
    return p, d, Target("p0", await p.start(), 8998), Target("d0", await d.start())


def _plan(p: Target, d: Target, body: dict[str, Any]) -> ForwardPlan:
    return ForwardPlan("rid-1", "/v1/completions", body, p, d, {"X-Request-Id": "rid-1"})


ORIGINAL = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 20,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 2,
}


def test_vllm_legs_carry_exactly_the_nixl_fields() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        done = []
        async with aiohttp.ClientSession() as s:
            plan = _plan(pt, dt, ORIGINAL)
            plan.on_prefill_done = lambda: done.append(True)
            up = await VLLMDriver().open(s, plan)
            body = b"".join([c async for c in up.chunks()])
            up.close()
        await p.server.close()
        await d.server.close()
        return p.seen, d.seen, body, done

    pseen, dseen, body, done = asyncio.run(run())
    ((path, pheaders, pbody),) = pseen
    assert path == "/v1/completions"
    assert pbody["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert pbody["stream"] is False and pbody["max_tokens"] == 1
    assert "stream_options" not in pbody and "min_tokens" not in pbody
    ((_, dheaders, dbody),) = dseen
    assert dbody == {**ORIGINAL, "kv_transfer_params": KV_PARAMS}
    assert pheaders["X-Request-Id"] == dheaders["X-Request-Id"] == "rid-1"
    assert body == SSE and done == [True]


def test_vllm_max_completion_tokens_is_also_one_on_prefill() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        async with aiohttp.ClientSession() as s:
            up = await VLLMDriver().open(
                s, _plan(pt, dt, {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9})
            )
            await up.read()
            up.close()
        await p.server.close()
        await d.server.close()
        return p.seen[0][2]

    pbody = asyncio.run(run())
    assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1


def test_sglang_sends_both_legs_at_once_with_one_bootstrap_room() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        async with aiohttp.ClientSession() as s:
            up = await SGLangDriver().open(s, _plan(pt, dt, ORIGINAL))
            body = b"".join([c async for c in up.chunks()])
            up.close()
        await p.server.close()
        await d.server.close()
        return p.seen, d.seen, body

    pseen, dseen, body = asyncio.run(run())
    pbody, dbody = pseen[0][2], dseen[0][2]
    # The prefill waited for the decode leg to arrive: the legs were concurrent.
    for b in (pbody, dbody):
        assert b["bootstrap_host"] == "127.0.0.1" and b["bootstrap_port"] == 8998
    assert pbody["bootstrap_room"] == dbody["bootstrap_room"]
    assert 0 <= dbody["bootstrap_room"] < 2**63
    assert dbody["stream"] is True and dbody["max_tokens"] == 20
    assert pbody["stream"] is False
    assert body == SSE


def test_colocated_is_one_unchanged_leg() -> None:
    async def run():
        d = StubEngine("decode")
        url = await d.start()
        async with aiohttp.ClientSession() as s:
            t = Target("c0", url)
            up = await ColocatedDriver().open(s, _plan(t, t, ORIGINAL))
            await up.read()
            up.close()
        await d.server.close()
        return d.seen

    (seen,) = asyncio.run(run())
    assert seen[2] == ORIGINAL


def test_engine_error_status_and_transport_error_are_distinguished() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        p.fail_with = 400
        errors = []
        async with aiohttp.ClientSession() as s:
            for target in (pt, Target("gone", "http://127.0.0.1:9")):
                try:
                    await VLLMDriver().open(s, _plan(target, dt, ORIGINAL))
                except UpstreamError as exc:
                    errors.append(exc)
        await p.server.close()
        await d.server.close()
        return errors, d.seen

    errors, decode_seen = asyncio.run(run())
    assert errors[0].status == 400 and b"boom" in errors[0].body
    assert errors[1].status is None and errors[1].instance_id == "gone"
    assert decode_seen == []  # a failed prefill never starts the decode leg
    assert json.loads(errors[0].body)["error"]["message"] == "boom"


def test_piece_reader_marks_the_last_piece_on_the_aiohttp_path() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        async with aiohttp.ClientSession() as s:
            up = await SGLangDriver().open(s, _plan(pt, dt, ORIGINAL))
            read, pieces = up.piece_reader(), []
            while (piece := await read()) is not None:
                pieces.append(piece)
            up.close()
        await p.server.close()
        await d.server.close()
        return pieces

    pieces = asyncio.run(run())
    assert b"".join(c for c, _ in pieces) == SSE
    assert [end for _, end in pieces] == [False] * (len(pieces) - 1) + [True]


def test_nixl_prefill_without_params_fails_clearly_and_sends_no_decode() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        p.params = None  # a prefill engine without a NixlConnector answers plainly
        async with aiohttp.ClientSession() as s:
            try:
                await VLLMDriver().open(s, _plan(pt, dt, ORIGINAL))
            except UpstreamError as exc:
                error = exc
        await p.server.close()
        await d.server.close()
        return error, d.seen

    error, decode_seen = asyncio.run(run())
    assert error.status == 502 and error.instance_id == "p0"
    assert "kv_transfer_params" in str(error) and "NixlConnector" in str(error)
    assert decode_seen == []


def test_shared_storage_prefills_one_token_then_sends_the_original_request() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        p.params = None  # ExampleConnector answers without parameters
        pt = Target("p0", pt.url, kv_connector=KVConnector.SHARED_STORAGE)
        raw = json.dumps(ORIGINAL).encode() + b" "  # forwarded byte for byte
        done = []
        async with aiohttp.ClientSession() as s:
            plan = _plan(pt, dt, ORIGINAL)
            plan.raw_body = raw
            plan.on_prefill_done = lambda: done.append(True)
            up = await VLLMDriver().open(s, plan)
            body = await up.read()
            up.close()
        await p.server.close()
        await d.server.close()
        return p.seen, d.seen, body, done

    pseen, dseen, body, done = asyncio.run(run())
    ((_, _, pbody),) = pseen
    assert pbody == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False}
    ((_, dheaders, dbody),) = dseen
    assert dbody == ORIGINAL and "kv_transfer_params" not in dbody
    assert dheaders["X-Request-Id"] == "rid-1"
    assert body == SSE and done == [True]


def test_nixl_decode_leg_is_delivered_even_when_cancelled_after_the_prefill() -> None:
    """The prefill engine holds the prompt's blocks for the decode leg: a request cancelled
    once the prefill answered must still reach the decode engine (which then frees them)."""

    async def run():
        p, d, pt, dt = await _pair()
        d.delay_s = 0.3  # the decode leg is still being posted when the request is cancelled
        driver = VLLMDriver()
        async with aiohttp.ClientSession() as s:
            plan = _plan(pt, dt, ORIGINAL)
            opened = asyncio.ensure_future(driver.open(s, plan))
            plan.on_prefill_done = lambda: asyncio.get_running_loop().call_soon(opened.cancel)
            try:
                await opened
            except asyncio.CancelledError:
                cancelled = True
            assert driver.pending  # the decode leg is being finished in the background
            await asyncio.gather(*driver.pending)
        await p.server.close()
        await d.server.close()
        return cancelled, d.seen, driver.pending

    cancelled, dseen, pending = asyncio.run(run())
    assert cancelled
    ((_, _, dbody),) = dseen
    assert dbody["kv_transfer_params"] == KV_PARAMS
    assert not pending


def _cancel_during_the_prefill(params: dict | None) -> tuple[int, list]:
    """A NIXL request cancelled 0.1 s into a 0.3 s prefill; waits for what it left running."""

    async def run():
        p, d, pt, dt = await _pair()
        p.params = params
        p.delay_s = 0.3
        driver = VLLMDriver()
        async with aiohttp.ClientSession() as s:
            opened = asyncio.ensure_future(driver.open(s, _plan(pt, dt, ORIGINAL)))
            await asyncio.sleep(0.1)
            opened.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await opened
            while driver.pending:  # the release task, then the decode leg it starts
                await asyncio.gather(*driver.pending)
        await p.server.close()
        await d.server.close()
        return len(p.seen), d.seen

    return asyncio.run(run())


def test_nixl_cancelled_during_the_prefill_still_releases_through_the_decode_leg() -> None:
    """Closing the prefill leg cannot be known to abort it (the engine may already be done and
    pinning the blocks): the prefill runs to its answer, then its decode leg is delivered and
    aborted, which is what frees the blocks."""
    prefills, dseen = _cancel_during_the_prefill(KV_PARAMS)
    assert prefills == 1
    ((_, _, dbody),) = dseen
    assert dbody["kv_transfer_params"] == KV_PARAMS


def test_nixl_cancelled_during_a_prefill_without_params_sends_no_decode_leg() -> None:
    # An answer without parameters pins nothing: there is nothing to release.
    prefills, dseen = _cancel_during_the_prefill(None)
    assert prefills == 1 and dseen == []


def test_driver_for_picks_by_protocol_and_topology() -> None:
    assert isinstance(driver_for(PDProtocol.VLLM, False), ColocatedDriver)
    assert isinstance(driver_for(PDProtocol.VLLM, True), VLLMDriver)
    assert isinstance(driver_for(PDProtocol.SGLANG, True), SGLangDriver)


def test_nixl_decode_unreachable_is_a_transport_error_that_names_the_held_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run():
        p, d, pt, dt = await _pair()
        await d.server.close()  # the decode engine is gone
        async with aiohttp.ClientSession() as s:
            try:
                await VLLMDriver().open(s, _plan(pt, dt, ORIGINAL))
            except UpstreamError as exc:
                error = exc
        await p.server.close()
        return error

    with caplog.at_level("WARNING", logger="backends.vllm_pd"):
        error = asyncio.run(run())
    assert error.status is None and error.instance_id == "d0"
    assert "KV lease" in caplog.text and "p0" in caplog.text


def test_vllm_late_decode_binding_sends_the_decode_leg_where_it_was_moved() -> None:
    """The decode leg goes after the prefill answered, so the gateway may still move it; the
    rebind is asked before ``on_prefill_done`` (which starts the decode in the books)."""

    async def run():
        p, d, pt, dt = await _pair()
        other = StubEngine("decode")
        ot = Target("d1", await other.start())
        order: list[str] = []
        async with aiohttp.ClientSession() as s:
            plan = _plan(pt, dt, ORIGINAL)
            plan.rebind_decode = lambda: order.append("rebind") or ot
            plan.on_prefill_done = lambda: order.append("prefill_done")
            up = await VLLMDriver().open(s, plan)
            body = b"".join([c async for c in up.chunks()])
            up.close()
        for e in (p, d, other):
            await e.server.close()
        return d.seen, other.seen, up.instance_id, body, order

    planned, moved, instance, body, order = asyncio.run(run())
    assert planned == [] and len(moved) == 1
    assert moved[0][2]["kv_transfer_params"] == KV_PARAMS
    assert instance == "d1" and body == SSE
    assert order == ["rebind", "prefill_done"]


def test_vllm_decode_leg_stays_when_the_rebind_keeps_it() -> None:
    async def run():
        p, d, pt, dt = await _pair()
        async with aiohttp.ClientSession() as s:
            plan = _plan(pt, dt, ORIGINAL)
            plan.rebind_decode = lambda: None
            up = await VLLMDriver().open(s, plan)
            await up.read()
            up.close()
        await p.server.close()
        await d.server.close()
        return d.seen, up.instance_id

    seen, instance = asyncio.run(run())
    assert len(seen) == 1 and instance == "d0"
