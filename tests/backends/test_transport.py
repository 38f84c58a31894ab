"""The two leg transports: picked per URL, one answer contract (``Leg``), one error contract
(``OSError`` for transport failures) whichever carried the leg."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from backends import http1
from backends.legs import ForwardPlan, Target, UpstreamError, UpstreamResponse, post_leg, read_leg
from backends.transport import (
    AiohttpLeg,
    AiohttpTransport,
    Http1Transport,
    Leg,
    _broken,
    transport_for,
)

BODY = b"data: one\n\ndata: two\n\n"


def test_transport_for_picks_the_lean_client_for_plain_http_only() -> None:
    async def go() -> None:
        client = http1.Http1Client()
        async with aiohttp.ClientSession() as session:
            assert isinstance(transport_for("http://e:8000", session, client), Http1Transport)
            assert isinstance(transport_for("https://e", session, client), AiohttpTransport)
            assert isinstance(transport_for("http://e:8000", session, None), AiohttpTransport)
            with pytest.raises(ConnectionError, match="no HTTP session"):
                transport_for("https://e", None, client)

    asyncio.run(go())


def test_http1_transport_refuses_other_schemes() -> None:
    async def go() -> None:
        with pytest.raises(ValueError, match="plain http"):
            await Http1Transport(http1.Http1Client()).post("https://e", "/x", b"", {}, 1.0)

    asyncio.run(go())


def test_aiohttp_errors_become_the_contracts_oserror() -> None:
    payload = _broken(aiohttp.ClientPayloadError("truncated"))
    assert isinstance(payload, ConnectionError) and "ClientPayloadError" in str(payload)
    refused = aiohttp.ClientOSError(111, "refused")
    assert _broken(refused) is refused  # already an OSError: kept, so its kind is still readable


async def _engine(status: int = 200) -> TestServer:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status != 200:
            return web.json_response({"error": "no"}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(BODY)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


def _plan(target: Target) -> ForwardPlan:
    return ForwardPlan("r1", "/v1/completions", {"prompt": "x"}, target, target, timeout_s=5.0)


@pytest.mark.parametrize("lean", [True, False])
def test_both_transports_stream_the_same_answer(lean: bool) -> None:
    async def go() -> tuple[int, str, bytes, bool]:
        server = await _engine()
        client = http1.Http1Client() if lean else None
        target = Target("e", str(server.make_url("")).rstrip("/"))
        try:
            async with aiohttp.ClientSession() as session:
                leg: Leg = await post_leg(session, target, _plan(target), {"prompt": "x"}, client)
                assert isinstance(leg, http1.Response if lean else AiohttpLeg)
                up = UpstreamResponse(leg, "e")
                parts = [chunk async for chunk in up.chunks()]
                done = up.complete
                up.close()
                return up.status, up.content_type, b"".join(parts), done
        finally:
            if client is not None:
                client.close()
            await server.close()

    status, ctype, body, done = asyncio.run(go())
    assert status == 200 and ctype.startswith("text/event-stream")
    assert body == BODY and done


@pytest.mark.parametrize("lean", [True, False])
def test_an_http_error_is_an_upstream_error_with_the_engines_body(lean: bool) -> None:
    async def go() -> UpstreamError:
        server = await _engine(status=503)
        client = http1.Http1Client() if lean else None
        target = Target("e", str(server.make_url("")).rstrip("/"))
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(UpstreamError) as info:
                    await post_leg(session, target, _plan(target), b"{}", client)
                return info.value
        finally:
            if client is not None:
                client.close()
            await server.close()

    err = asyncio.run(go())
    assert err.status == 503 and b"no" in err.body and err.instance_id == "e"


def test_read_leg_reads_to_the_end_and_releases() -> None:
    async def go() -> tuple[bytes, bool]:
        server = await _engine()
        client = http1.Http1Client()
        target = Target("e", str(server.make_url("")).rstrip("/"))
        try:
            leg = await post_leg(None, target, _plan(target), b"{}", client)
            body = await read_leg(leg)
            return body, leg.complete
        finally:
            client.close()
            await server.close()

    body, complete = asyncio.run(go())
    assert body == BODY and complete
