"""Replication through the engine-pull sink against real emulators on loopback."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import aiohttp

from config.settings import ReplicationSettings, ReplicationSink, Settings
from gateway.stack import LiveStack, StackSpec
from routing.types import ReplicationCommand, ReplicationReason


def _settings(**rep) -> Settings:
    base = Settings()
    return replace(base, replication=ReplicationSettings(sink=ReplicationSink.ENGINE, **rep))


async def _complete(session, url, prompt, **extra):
    async with session.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, **extra}
    ) as r:
        return r.status, dict(r.headers), await r.json()


def test_engine_sink_copies_a_prefix_and_both_instances_then_hit_it() -> None:
    async def run():
        stack = LiveStack(StackSpec(prefill=2, decode=1, time_scale=0.02, base=_settings()))
        await stack.start()
        try:
            gw = stack.gateway
            prompt = list(range(5000, 5000 + 64 * 16))  # 64 blocks of 16 tokens
            async with aiohttp.ClientSession() as s:
                status, headers, _ = await _complete(s, stack.url, prompt)
                assert status == 200
                holder = headers["x-kvgate-prefill"]
                other = "p1" if holder == "p0" else "p0"
                blocks = gw.hasher.hash_tokens(prompt)
                cmd = ReplicationCommand(
                    "manual-1",
                    holder,
                    other,
                    blocks,
                    len(blocks) * 16,
                    ReplicationReason.PROACTIVE,
                    blocks[-1],
                    gw.clock(),
                )
                # A proactive copy runs in the background: no request waits for it.
                assert gw.replicator.execute((cmd,)) == []
                for _ in range(200):
                    await asyncio.sleep(0.02)
                    if gw.replicator.log[-1].state != "in_flight":
                        break
                entry = gw.replicator.log[-1]
                # The destination engine now serves the prompt from its cache.
                async with s.post(
                    stack.emulators[other].url + "/v1/completions",
                    json={"prompt": prompt, "max_tokens": 1},
                ) as r:
                    usage = (await r.json())["usage"]
            held = [iid for iid in ("p0", "p1") if gw.conductor.index.holds(iid, blocks[-1])]
            metrics = gw.metrics.render().decode()
            return entry, usage, held, metrics
        finally:
            await stack.stop()

    entry, usage, held, metrics = asyncio.run(run())
    assert entry.state == "confirmed", entry
    assert entry.latency_s > 0
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 63 * 16
    assert sorted(held) == ["p0", "p1"]
    assert 'kvgate_replication_commands_total{reason="proactive",state="confirmed"} 1.0' in metrics
    assert "kvgate_replication_confirm_seconds_count 1.0" in metrics


def test_failed_copy_leaves_the_index_unchanged() -> None:
    async def run():
        stack = LiveStack(
            StackSpec(prefill=2, decode=1, time_scale=0.02, base=_settings(max_retries=1))
        )
        await stack.start()
        try:
            gw = stack.gateway
            blocks = tuple(range(1, 9))
            # The destination's URL now points nowhere: every attempt fails.
            from backends.drivers import Target

            gw.targets["p1"] = Target("p1", "http://127.0.0.1:9")
            cmd = ReplicationCommand(
                "manual-2",
                "p0",
                "p1",
                blocks,
                128,
                ReplicationReason.PROACTIVE,
                blocks[-1],
                gw.clock(),
            )
            gw.replicator.execute((cmd,))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if gw.replicator.log[-1].state != "in_flight":
                    break
            return (
                gw.replicator.log[-1],
                gw.conductor.index.holds("p1", blocks[-1]),
                len(gw.conductor.planner.in_flight),
            )
        finally:
            await stack.stop()

    entry, held, in_flight = asyncio.run(run())
    assert entry.state == "failed" and entry.attempts == 2
    assert not held and in_flight == 0
