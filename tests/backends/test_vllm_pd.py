"""vLLM's P/D driver against a recording stub engine: the exact fields each leg receives, and
what a failed, cancelled or moved request sends."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest

from backends.drivers import (
    Target,
    UpstreamError,
    VLLMDriver,
)
from config.settings import KVConnector
from tests.backends.pd_stub import KV_PARAMS, ORIGINAL, SSE, StubEngine, forward_plan, pair


def test_vllm_legs_carry_exactly_the_nixl_fields() -> None:
    async def run():
        p, d, pt, dt = await pair()
        done = []
        async with aiohttp.ClientSession() as s:
            plan = forward_plan(pt, dt, ORIGINAL)
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
        p, d, pt, dt = await pair()
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "x", "max_tokens": 9, "max_completion_tokens": 9}
            up = await VLLMDriver().open(s, forward_plan(pt, dt, body))
            await up.read()
            up.close()
        await p.server.close()
        await d.server.close()
        return p.seen[0][2]

    pbody = asyncio.run(run())
    assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1


def test_engine_error_status_and_transport_error_are_distinguished() -> None:
    async def run():
        p, d, pt, dt = await pair()
        p.fail_with = 400
        errors = []
        async with aiohttp.ClientSession() as s:
            for target in (pt, Target("gone", "http://127.0.0.1:9")):
                try:
                    await VLLMDriver().open(s, forward_plan(target, dt, ORIGINAL))
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


def test_nixl_prefill_without_params_fails_clearly_and_sends_no_decode() -> None:
    async def run():
        p, d, pt, dt = await pair()
        p.params = None  # a prefill engine without a NixlConnector answers plainly
        async with aiohttp.ClientSession() as s:
            try:
                await VLLMDriver().open(s, forward_plan(pt, dt, ORIGINAL))
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
        p, d, pt, dt = await pair()
        p.params = None  # ExampleConnector answers without parameters
        pt = Target("p0", pt.url, kv_connector=KVConnector.SHARED_STORAGE)
        raw = json.dumps(ORIGINAL).encode() + b" "  # forwarded byte for byte
        done = []
        async with aiohttp.ClientSession() as s:
            plan = forward_plan(pt, dt, ORIGINAL)
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
        p, d, pt, dt = await pair()
        d.delay_s = 0.3  # the decode leg is still being posted when the request is cancelled
        driver = VLLMDriver()
        async with aiohttp.ClientSession() as s:
            plan = forward_plan(pt, dt, ORIGINAL)
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
        p, d, pt, dt = await pair()
        p.params = params
        p.delay_s = 0.3
        driver = VLLMDriver()
        async with aiohttp.ClientSession() as s:
            opened = asyncio.ensure_future(driver.open(s, forward_plan(pt, dt, ORIGINAL)))
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


def test_nixl_decode_unreachable_is_a_transport_error_that_names_the_held_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run():
        p, d, pt, dt = await pair()
        await d.server.close()  # the decode engine is gone
        async with aiohttp.ClientSession() as s:
            try:
                await VLLMDriver().open(s, forward_plan(pt, dt, ORIGINAL))
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
        p, d, pt, dt = await pair()
        other = StubEngine("decode")
        ot = Target("d1", await other.start())
        order: list[str] = []
        async with aiohttp.ClientSession() as s:
            plan = forward_plan(pt, dt, ORIGINAL)
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
        p, d, pt, dt = await pair()
        async with aiohttp.ClientSession() as s:
            plan = forward_plan(pt, dt, ORIGINAL)
            plan.rebind_decode = lambda: None
            up = await VLLMDriver().open(s, plan)
            await up.read()
            up.close()
        await p.server.close()
        await d.server.close()
        return d.seen, up.instance_id

    seen, instance = asyncio.run(run())
    assert len(seen) == 1 and instance == "d0"
