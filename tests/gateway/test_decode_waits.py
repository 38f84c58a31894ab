"""Clients waiting for decode room (gateway/decode_waits.py): a finished decode admits the
waiting request and books it; a deadline, a drain or the tenants' screen end the wait with the
rejection. Real Conductor (its TBT check fails on a full decode batch), real asyncio."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from config.admission_settings import DecodeQueueSettings
from gateway.decode_waits import DecodeWaits
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RejectReason, RequestInfo
from tests.routing.fleet import full_decode_conductor, prompt, request


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _setup(**queue: object) -> tuple[Conductor, DecodeWaits, _Clock, RequestInfo, Rejection]:
    c = full_decode_conductor()
    if queue:
        admission = replace(c.settings.admission, decode_queue=DecodeQueueSettings(**queue))  # type: ignore[arg-type]
        c.apply_settings(replace(c.settings, admission=admission))
    clock = _Clock()
    waits = DecodeWaits(c, clock)
    req = request("r", prompt(1, 8))
    rej = c.schedule(req, 0.0)
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.TBT_SLO
    return c, waits, clock, req, rej


def _free_room(c: Conductor, now: float) -> None:
    for i in range(100):
        c.instances["d0"].remove_decode(f"run{i}", now)


def test_a_finished_decode_admits_and_books_the_waiting_request() -> None:
    c, waits, clock, req, rej = _setup()

    async def run() -> Decision | Rejection:
        task = asyncio.create_task(waits.wait(rej, req))
        await asyncio.sleep(0)
        assert len(waits) == 1 and "r" in c.decode_queue
        clock.t = 0.5
        waits.decode_done(clock.t)  # no room yet: it keeps waiting
        assert not task.done()
        _free_room(c, 1.0)
        clock.t = 1.0
        for hook in c.after_finished:  # as Conductor.finished runs them
            hook(clock.t)
        return await task

    out = asyncio.run(run())
    assert isinstance(out, Decision) and out.request_id == "r"
    assert "r" in c.requests  # booked when admitted, before its handler went on
    assert len(waits) == 0 and c.decode_queue.admitted == 1


def test_the_wait_ends_with_the_rejection_at_its_deadline_or_a_drain() -> None:
    c, waits, _, req, rej = _setup(max_wait_s=0.05)
    assert asyncio.run(waits.wait(rej, req)) is rej  # 50 ms, nothing finished
    assert "r" not in c.decode_queue and "r" not in c.requests

    c, waits, _, req, rej = _setup()

    async def drained() -> Decision | Rejection:
        task = asyncio.create_task(waits.wait(rej, req))
        await asyncio.sleep(0)
        waits.end_all()
        return await task

    assert asyncio.run(drained()) is rej
    assert "r" not in c.decode_queue


def _booked_batch(c: Conductor) -> list[str]:
    """The full batch of ``_setup`` as requests the Conductor booked itself (so that their
    ``failed`` is what frees the room), still failing the waiting request's TBT check."""
    _free_room(c, 0.0)
    placed = c.schedule(request("x", prompt(2, 8)), 0.0)
    assert isinstance(placed, Decision) and placed.decode == "d0"
    ids = [f"run{i}" for i in range(100)]
    for i, rid in enumerate(ids):
        info = replace(request(rid, prompt(10 + i, 8)), prompt_tokens=3000)
        c.dispatched(replace(placed, request_id=rid), info, 0.0)
        c.prefill_done(rid, 0.0)  # decoding
    return ids


def test_a_failed_request_frees_its_decode_room_for_a_waiting_one() -> None:
    """A client that leaves mid-decode (or an engine error) frees its room as a finished
    decode does: the waiting request is admitted then, not at the next completed decode. A
    decode that refused the request at join freed nothing: nobody is admitted."""

    async def run(decode_refused: bool) -> tuple[Decision | Rejection | None, int]:
        c, waits, clock, req, _ = _setup()
        batch = _booked_batch(c)
        rej = c.schedule(req, 0.0)
        assert isinstance(rej, Rejection) and rej.reason is RejectReason.TBT_SLO
        task = asyncio.create_task(waits.wait(rej, req))
        await asyncio.sleep(0)
        clock.t = 1.0
        failed = 0
        for rid in batch:
            c.failed(rid, clock.t, decode_refused=decode_refused)
            failed += 1
            await asyncio.sleep(0)
            if task.done():
                break
        out = task.result() if task.done() else None
        task.cancel()
        return out, failed

    out, failed = asyncio.run(run(decode_refused=False))
    assert isinstance(out, Decision) and out.request_id == "r"
    assert failed < 100  # admitted as soon as enough of the batch had left, not at its end
    out, failed = asyncio.run(run(decode_refused=True))
    assert out is None and failed == 100


def test_a_tenant_over_its_share_by_then_is_turned_away_unbooked() -> None:
    c, waits, _, req, rej = _setup()
    refused = replace(rej, reason=RejectReason.TBT_SLO, message="over its share")

    async def run() -> Decision | Rejection:
        task = asyncio.create_task(waits.wait(rej, req, lambda d, info, now: refused))
        await asyncio.sleep(0)
        _free_room(c, 1.0)
        waits.decode_done(1.0)
        return await task

    assert asyncio.run(run()) is refused
    assert "r" not in c.requests


def test_through_the_proxy_a_request_waits_for_the_decode_that_finishes() -> None:
    """Two stub engines; a TBT SLO that one decode meets and two together do not. While A
    decodes (the stub holds it 0.6 s), B is turned away on its TBT check and waits instead of
    hearing 429; A's end admits it and it is served."""
    import time

    import aiohttp
    import uvicorn

    from config.loader import settings_from_dict
    from gateway.app import build_app
    from routing.conductor import Conductor as Core
    from tests.backends.pd_stub import StubEngine

    async def run() -> tuple[list[tuple[str, int, float]], str]:
        p, d = StubEngine("prefill"), StubEngine("decode")
        p.partner, d.delay_s = d, 0.6
        purl, durl = await p.start(), await d.start()
        raw = {
            "admission": {"mode": "early", "tbt_headroom": {"adaptive": False}},
            "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
            "pools": [
                {"name": "p", "role": "prefill", "instances": [{"id": "p0", "url": purl}]},
                {"name": "d", "role": "decode", "instances": [{"id": "d0", "url": durl}]},
            ],
        }
        step = Core(settings_from_dict(raw)).instances["d0"].predictors.decode.step_time
        one, two = step(1, 200), step(2, 200)  # prompts of ~75 tokens: well inside both
        raw["slo"] = {"tbt_s": (one + two) / 2 / 0.9}  # the normal class keeps 10 %
        app = build_app(settings_from_dict(raw))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
        )
        task = asyncio.create_task(server.serve())
        done: list[tuple[str, int, float]] = []
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
            gw = app.gateway
            t0 = time.monotonic()

            async def post(s: aiohttp.ClientSession, rid: str) -> None:
                body = {"prompt": "hello " * 50, "max_tokens": 8, "stream": True}
                async with s.post(
                    url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
                ) as r:
                    await r.read()
                    done.append((rid, r.status, time.monotonic() - t0))

            async with aiohttp.ClientSession() as s:
                a = asyncio.create_task(post(s, "A"))
                for _ in range(200):  # until A decodes (its prefill answered), bounded
                    rec = gw.conductor.requests.get("A")
                    if rec is not None and rec.prefill_done_s is not None:
                        break
                    await asyncio.sleep(0.01)
                b = asyncio.create_task(post(s, "B"))
                await asyncio.wait_for(asyncio.gather(a, b), 10)
                async with s.get(url + "/metrics") as r:
                    metrics = await r.text()
        finally:
            server.should_exit = True
            await task
            await p.server.close()
            await d.server.close()
        return done, metrics

    done, metrics = asyncio.run(run())
    assert [(rid, status) for rid, status, _ in done] == [("A", 200), ("B", 200)]
    assert done[1][2] >= done[0][2] + 0.3  # B's decode began after A's ended
    assert 'kvgate_decode_queue{state="admitted"} 1.0' in metrics
    assert 'kvgate_decode_queue{state="waiting"} 0.0' in metrics


def test_a_failing_release_is_logged_not_passed_to_the_finishing_request(caplog) -> None:
    c, _waits, _, _, _ = _setup()  # its hook is registered

    def broken(now: float) -> None:
        raise RuntimeError("boom")

    c.release_parked = broken  # type: ignore[method-assign]
    for hook in c.after_finished:  # as Conductor.finished runs them: nothing raised
        hook(1.0)
    assert "releasing a waiting request failed" in caplog.text


def test_a_wait_cancelled_just_after_its_release_leaves_no_booking_behind() -> None:
    """The client went away in the instant between the release (which booked the request)
    and its handler going on. Python >= 3.12 delivers the cancellation: the wait takes the
    booking back. 3.11's ``wait_for`` hands the result over instead (the cancellation is
    lost), and the caller holds the booking like any decision."""
    c, waits, clock, req, rej = _setup()

    async def run() -> tuple[Decision | Rejection | None, bool]:
        held = waits.hold(rej, req)
        assert held is not None
        task = asyncio.create_task(waits.settle(held))
        await asyncio.sleep(0)
        _free_room(c, 1.0)
        clock.t = 1.0
        waits.decode_done(clock.t)
        assert "r" in c.requests  # booked by the release
        task.cancel()  # before the handler resumed
        try:
            return await task, "r" in c.requests
        except asyncio.CancelledError:
            return None, "r" in c.requests

    out, booked = asyncio.run(run())
    if out is None:
        assert not booked
    else:
        assert isinstance(out, Decision) and booked
    assert "r" not in c.decode_queue and len(waits) == 0
