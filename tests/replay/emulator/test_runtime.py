"""The real-time driver: updates in order, at (scaled) model times, aborts, refusals."""

from __future__ import annotations

import asyncio

import pytest

from config.settings import Role
from predictors.profiles import get_profile
from replay.emulator.runtime import EngineRuntime, Kind, Refused, RequestStream, Update
from replay.engine.engine import Engine
from replay.engine.prefix_cache import PrefixCache
from replay.engine.timing import StepTiming

PROFILE = get_profile("llama2-70b-a100-tp8")  # slow steps (~15 ms): timing is measurable
TIMING = StepTiming.from_profile(PROFILE)
SCALE = 0.1


def make_runtime(**kw: object) -> EngineRuntime:
    engine = Engine(
        "e0",
        Role.BOTH,
        TIMING,
        cache=PrefixCache(10_000),
        max_batch=64,
        kv_capacity_tokens=100_000,
        max_segment_steps=1,
        **kw,  # type: ignore[arg-type]
    )
    return EngineRuntime(engine, SCALE, 16)


async def drain(stream: RequestStream) -> list[Update]:
    out = []
    while True:
        u = await asyncio.wait_for(stream.next(), 5)
        out.append(u)
        if u.kind in (Kind.FINISHED, Kind.FAILED):
            return out


def test_colocated_request_streams_every_token_at_model_time() -> None:
    async def main() -> None:
        rt = make_runtime()
        rt.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stream = rt.submit_prefill("a", tuple(range(32)), 512, 4)
        first = await stream.next()
        ttft = loop.time() - t0
        rest = await drain(stream)
        total = loop.time() - t0
        await rt.stop()
        assert first == Update(Kind.PREFILLED, 1, 0)
        assert [u.kind for u in rest] == [Kind.TOKENS] * 3 + [Kind.FINISHED]
        assert sum(u.tokens for u in rest) == 3
        prefill = TIMING.prefill(512, 0)
        decode = TIMING.decode_steps(1, 513, 3)
        assert ttft >= prefill * SCALE * 0.99
        assert total >= (prefill + decode) * SCALE * 0.99
        assert total < (prefill + decode) * SCALE * 3 + 0.1
        assert rt.inflight == 0 and not rt.engine.running

    asyncio.run(main())


def test_second_prompt_hits_the_prefix_cache() -> None:
    async def main() -> None:
        rt = make_runtime()
        rt.start()
        blocks = tuple(range(10))
        await drain(rt.submit_prefill("a", blocks, 160, 1))
        second = await drain(rt.submit_prefill("b", blocks, 160, 1))
        await rt.stop()
        assert second[0] == Update(Kind.PREFILLED, 1, 159)  # the last token is recomputed
        assert second[1].kind is Kind.FINISHED

    asyncio.run(main())


def test_abort_takes_a_decoding_request_out_of_the_engine() -> None:
    async def main() -> None:
        rt = make_runtime()
        rt.start()
        stream = rt.submit_prefill("a", (), 100, 1000)
        assert (await stream.next()).kind is Kind.PREFILLED
        await stream.next()  # decoding now
        assert "a" in rt.engine.running
        rt.abort("a")
        assert "a" not in rt.engine.running and rt.inflight == 0
        await asyncio.sleep(0.05)  # idle again: the next submission is planned at once
        assert rt.engine.next_event_s() is None
        # An abort during the prefill step itself is honoured when the prefill surfaces.
        s2 = rt.submit_prefill("b", (), 4000, 1000)
        rt.abort("b")
        assert rt.engine.queue  # mid-step: the engine cannot drop it yet
        await asyncio.sleep(TIMING.prefill(4000, 0) * SCALE + 0.05)
        assert "b" not in rt.engine.running and not rt.engine.queue
        assert s2.updates.empty()
        await rt.stop()

    asyncio.run(main())


def test_a_decode_request_hears_when_the_batch_takes_it_in() -> None:
    async def main() -> None:
        rt = make_runtime()
        rt.start()
        loop = asyncio.get_running_loop()
        first = rt.submit_decode("a", 1000, 50)  # idle engine: joins at once
        assert first.updates.get_nowait() == Update(Kind.JOINED)
        assert (await first.next()).kind is Kind.TOKENS  # decoding now, mid-step
        t0 = loop.time()
        second = rt.submit_decode("b", 1000, 3)
        assert second.updates.empty()  # it waits for the step boundary
        joined = await second.next()
        waited = loop.time() - t0
        updates = await drain(second)
        await rt.stop()
        assert joined == Update(Kind.JOINED)
        assert [u.kind for u in updates] == [Kind.TOKENS] * 3 + [Kind.FINISHED]
        assert waited <= TIMING.decode_steps(2, 2000, 1) * SCALE + 0.05
        # A request aborted before its join is forgotten, not awaited for ever.
        rt2 = make_runtime()
        rt2.start()
        rt2.submit_decode("c", 1000, 50)
        late = rt2.submit_decode("d", 1000, 5)  # waits for the boundary
        rt2.abort("d")
        await drain(rt2.submit_decode("e", 500, 2))
        assert late.updates.empty() and not rt2._awaiting_join
        await rt2.stop()

    asyncio.run(main())


def test_decode_refusals_and_unique_ids() -> None:
    async def main() -> None:
        rt = make_runtime(decode_tbt_limit_s=0.001)  # below any step time
        rt.start()
        with pytest.raises(Refused) as err:
            rt.submit_decode("d", 100, 10)
        assert err.value.reason == "tbt_slo"
        stream = rt.submit_prefill("x", (), 50, 1)
        assert rt.unique_id("x") != "x" and rt.unique_id("y") == "y"
        await drain(stream)
        assert rt.unique_id("x") == "x"
        await rt.stop()

    asyncio.run(main())


def test_stop_fails_requests_in_flight() -> None:
    async def main() -> None:
        rt = make_runtime()
        rt.start()
        stream = rt.submit_prefill("a", (), 100, 10_000)
        await stream.next()
        await rt.stop()
        updates = []
        while not stream.updates.empty():
            updates.append(stream.updates.get_nowait())
        assert updates[-1].kind is Kind.FAILED

    asyncio.run(main())
