"""Shared steps of the real-engine replication tests: one-token completions, an engine's
counters, and a hot prefix copied through a running gateway's replicator."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

from config.settings import Settings
from gateway.openai import parse_request
from gateway.replicator import ReplicationRecord
from gateway.runtime import Gateway
from routing.conductor import Conductor
from routing.types import ReplicationCommand


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    """A one-token greedy completion of a token-id prompt, sent to the engine directly."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(
        url + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def vllm_metric(url: str, name: str) -> float:
    """A vLLM counter summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in resp.read().decode().splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")
        )


async def copy_hot_prefix(
    settings: Settings, raw: bytes, *, engine_block: int | None, wait_s: float = 90.0
) -> tuple[ReplicationRecord, ReplicationCommand, Conductor]:
    """Through a gateway on ``settings`` (instances ``src`` and ``dst``): the completion
    ``raw`` is routed to ``src``, which is the bottleneck, so the hot-spot planner orders a
    proactive copy of its prefix to ``dst``, which does not hold it yet; the pool's sink runs
    it in the background. ``engine_block``: dst's KV block size, read from its metrics first
    (vLLM, whose KV events then confirm the copy); None for an engine without them. Returns
    the copy's log entry once it left ``in_flight``, the command and the Conductor."""
    gw = Gateway(settings)
    await gw.startup()
    try:
        for _ in range(100 if engine_block is not None else 0):  # a scrape reads the layout
            await asyncio.sleep(0.1)
            load = gw.scraper.latest("dst", gw.clock()) if gw.scraper else None
            if load is not None and load.block_size is not None:
                assert load.block_size == engine_block
                break
        else:
            assert engine_block is None, "dst's KV block size never showed in its metrics"
        now = gw.clock()
        parsed = parse_request(
            "/v1/completions",
            raw,
            {},
            "req-1",
            now,
            settings=gw.settings,
            encoder=gw.prompt_encoder,
            hasher=gw.hasher,
        )
        conductor = gw.conductor
        src_state, dst_state = conductor.instances["src"], conductor.instances["dst"]
        conductor.index.record_route("src", parsed.info.block_hashes, now)
        src_state.enqueue_prefill("busy", 5.0, 4000, now, now)  # queue past the threshold
        match = conductor.index.match(parsed.info.block_hashes, now)
        cmd = conductor.planner.proactive(
            parsed.info, match, [dst_state, src_state], conductor.instances, 1.0, None, now
        )
        assert cmd is not None and (cmd.source, cmd.destination) == ("src", "dst")
        assert not conductor.index.holds("dst", cmd.prefix_key)
        # what the proxy does with a decision that carries commands
        gw.replicator.remember_prompt("/v1/completions", parsed)
        assert gw.replicator.execute((cmd,)) == []  # proactive: nobody waits for it
        for _ in range(int(wait_s * 10)):
            if gw.replicator.log[-1].state != "in_flight":
                break
            await asyncio.sleep(0.1)
        return gw.replicator.log[-1], cmd, conductor
    finally:
        await gw.shutdown()
