"""Protocol drivers (SGLang, colocated, the choice of driver) against a recording stub engine:
the exact fields each leg receives. vLLM's: tests/backends/test_vllm_pd.py."""

from __future__ import annotations

import asyncio

import aiohttp

from backends.drivers import (
    ColocatedDriver,
    SGLangDriver,
    Target,
    VLLMDriver,
    driver_for,
)
from config.settings import PDProtocol
from tests.backends.pd_stub import ORIGINAL, SSE, StubEngine, forward_plan, pair


def test_sglang_sends_both_legs_at_once_with_one_bootstrap_room() -> None:
    async def run():
        p, d, pt, dt = await pair()
        async with aiohttp.ClientSession() as s:
            up = await SGLangDriver().open(s, forward_plan(pt, dt, ORIGINAL))
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
            up = await ColocatedDriver().open(s, forward_plan(t, t, ORIGINAL))
            await up.read()
            up.close()
        await d.server.close()
        return d.seen

    (seen,) = asyncio.run(run())
    assert seen[2] == ORIGINAL


def test_piece_reader_marks_the_last_piece_on_the_aiohttp_path() -> None:
    async def run():
        p, d, pt, dt = await pair()
        async with aiohttp.ClientSession() as s:
            up = await SGLangDriver().open(s, forward_plan(pt, dt, ORIGINAL))
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


def test_driver_for_picks_by_protocol_and_topology() -> None:
    assert isinstance(driver_for(PDProtocol.VLLM, False), ColocatedDriver)
    assert isinstance(driver_for(PDProtocol.VLLM, True), VLLMDriver)
    assert isinstance(driver_for(PDProtocol.SGLANG, True), SGLangDriver)
