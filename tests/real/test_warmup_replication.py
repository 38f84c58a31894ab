"""Warm-up replication on two real llama.cpp servers (``-np 2 --cache-ram 0``), which have no
KV-copy API and no KV events: a prefix made hot on the first gets a copy on the second through
the warm-up sink, and the second engine's own counters (``timings.cache_n``,
``llamacpp:prompt_tokens_cached_total``) show the hits afterwards.

Prompts are token ids (llama.cpp takes them on /v1/completions as vLLM does), drawn from the
tiny model's vocabulary, so the test needs no tokenizer files.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest

from backends.prefix_tokens import PrefixTokenStore
from backends.warmup_sink import ConductorCluster, WarmupSink
from config.settings import (
    InstanceSettings,
    PoolSettings,
    ReplicationSettings,
    ReplicationSink,
    Role,
    Settings,
)
from routing.conductor import Conductor
from routing.hashing import BlockHasher
from routing.tokenizer import pack_token_ids
from routing.types import ReplicationCommand, ReplicationReason
from tests.real.conftest import EngineInstall
from tests.real.engines import (
    EngineProcess,
    free_ports,
    start_llama_server,
    start_vllm,
    stop_engine,
)
from tests.real.llama_fleet import token_ids
from tests.real.replication_harness import complete, copy_hot_prefix, vllm_metric

pytestmark = pytest.mark.real_engine

BS = 16
PREFIX_TOKENS = 1024  # 64 blocks: the hot system prompt


PREFIX = token_ids(1, PREFIX_TOKENS)


def _cached_total(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llamacpp:prompt_tokens_cached_total "):
                return float(line.split()[1])
    raise AssertionError(f"{url}/metrics has no llamacpp:prompt_tokens_cached_total")


@pytest.fixture
def llama_pair(llamacpp_install: EngineInstall) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    ports = free_ports(2, 18710, 18799)
    first = start_llama_server(ports[0], slots=2, cache_ram_mib=0)
    try:
        second = start_llama_server(ports[1], slots=2, cache_ram_mib=0)
    except BaseException:
        stop_engine(first)
        raise
    yield first, second
    stop_engine(second)
    stop_engine(first)


def _settings(src: EngineProcess, dst: EngineProcess) -> Settings:
    base = Settings()
    insts = (
        InstanceSettings("src", src.url, Role.BOTH),
        InstanceSettings("dst", dst.url, Role.BOTH),
    )
    return replace(
        base,
        routing=replace(base.routing, block_size=BS),
        pools=(PoolSettings("llama", Role.BOTH, insts, replication_sink=ReplicationSink.WARMUP),),
        replication=ReplicationSettings(timeout_s=60.0),
        server=replace(base.server, refit_interval_s=0),
    )


def _make_hot(src: EngineProcess) -> list[dict[str, Any]]:
    """Requests that share the prefix, sent to the first engine only."""
    answers = [complete(src.url, PREFIX + token_ids(10 + i, 40)) for i in range(3)]
    assert answers[0]["timings"]["cache_n"] == 0
    for later in answers[1:]:
        assert later["timings"]["cache_n"] >= PREFIX_TOKENS  # hot on the first engine
    return answers


def _command(hashes: tuple[int, ...]) -> ReplicationCommand:
    blocks = hashes[: PREFIX_TOKENS // BS]
    return ReplicationCommand(
        "warm-1",
        "src",
        "dst",
        blocks,
        len(blocks) * BS,
        ReplicationReason.PROACTIVE,
        blocks[-1],
        time.monotonic(),
    )


def test_warmup_sink_copies_a_hot_prefix_to_a_second_llama_server(llama_pair) -> None:
    src, dst = llama_pair
    _make_hot(src)
    cold = complete(dst.url, token_ids(99, PREFIX_TOKENS + 40))  # a cold prompt of the same size
    hits_before = _cached_total(dst.url)
    probe_before = token_ids(20, 40)

    # What the gateway kept of the request that made the prefix hot.
    prompt = PREFIX + token_ids(10, 40)
    hashes = BlockHasher(BS).hash_tokens(prompt)
    store = PrefixTokenStore(BS)
    store.remember(hashes, pack_token_ids(prompt), model="tiny")
    settings = _settings(src, dst)
    conductor = Conductor(settings)
    urls = {"src": src.url, "dst": dst.url}

    async def warm() -> Any:
        async with aiohttp.ClientSession() as session:
            cluster = ConductorCluster(
                conductor, time.monotonic, urls.get, lambda iid: False, max_queue_s=0.5
            )
            sink = WarmupSink(
                session, cluster, store, kv_bytes_per_token={"dst": 1}, timeout_s=60.0
            )
            return await sink.execute(_command(hashes))

    result = asyncio.run(warm())
    assert result.ok, result
    assert result.bytes == PREFIX_TOKENS  # 1 byte per token here: the tokens it prefilled

    after = complete(dst.url, PREFIX + probe_before)
    hits_after = _cached_total(dst.url)
    assert after["timings"]["cache_n"] >= PREFIX_TOKENS
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_TOKENS
    assert hits_after - hits_before >= PREFIX_TOKENS
    print(
        f"\nwarm-up of {PREFIX_TOKENS} tokens on {dst.url}: {result.latency_s * 1e3:.1f} ms "
        f"(attempts {result.attempts}); destination prompt_tokens_cached_total "
        f"{hits_before:.0f} -> {hits_after:.0f}; next request with the prefix: cache_n "
        f"{after['timings']['cache_n']}, prompt_ms {after['timings']['prompt_ms']:.1f} "
        f"(a cold {PREFIX_TOKENS + 40}-token prompt there: {cold['timings']['prompt_ms']:.1f})"
    )


def test_gateway_replicates_through_the_pools_warmup_sink(llama_pair) -> None:
    """The gateway's own wiring: the pool's sink, the prompt kept from a parsed request, a
    proactive command from the hot-spot planner run in the background, and the copy recorded
    in the KV index once the engine's answer confirmed it."""
    src, dst = llama_pair
    _make_hot(src)
    hits_before = _cached_total(dst.url)
    prompt = PREFIX + token_ids(11, 40)
    raw = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8}).encode()
    settings = _settings(src, dst)
    settings = replace(settings, replication=replace(settings.replication, hot_rate_per_s=0.01))

    entry, cmd, conductor = asyncio.run(copy_hot_prefix(settings, raw, engine_block=None))
    held_after = conductor.index.holds("dst", cmd.prefix_key)
    assert entry.sink == "warmup"
    assert entry.state == "confirmed", entry
    assert held_after  # held_before was False (copy_hot_prefix checks)
    after = complete(dst.url, PREFIX + token_ids(21, 40))
    assert after["timings"]["cache_n"] >= PREFIX_TOKENS
    assert _cached_total(dst.url) - hits_before >= PREFIX_TOKENS
    print(
        f"\ngateway warm-up: {entry.tokens} tokens in {entry.blocks} blocks, "
        f"{float(entry.latency_s) * 1e3:.1f} ms, state {entry.state}; next request's "
        f"cache_n on the destination {after['timings']['cache_n']}"
    )


VLLM_VOCAB_HI = 4000  # the tiny HF model has 4096 tokens
VLLM_BLOCK = 32
# 33 of kvgate's 16-token blocks: the engine caches 16 of its 32-token blocks (512 tokens), so
# kvgate's last block can never be confirmed by its events and must not be waited for.
VLLM_PREFIX = [random.Random(5).randrange(100, VLLM_VOCAB_HI) for _ in range(33 * BS)]
VLLM_CACHEABLE = len(VLLM_PREFIX) // VLLM_BLOCK * VLLM_BLOCK


@pytest.fixture
def vllm_destination(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    (port,) = free_ports(1, 18720, 18799)
    # Start-up takes 60-110 s here on an idle machine and longer when other engines share it.
    proc = start_vllm(port, kv_events_endpoint=f"ipc://{sock}", timeout_s=360)
    yield proc
    stop_engine(proc)


def test_warmup_on_vllm_is_confirmed_by_its_kv_events(vllm_destination) -> None:
    """vLLM publishes KV events: the copy counts only once the destination's own BlockStored
    events put every block of the prefix in kvgate's index as confirmed. The source is a
    holder in kvgate's books only (the sink never contacts it)."""
    dst = vllm_destination
    base = Settings()
    insts = (
        InstanceSettings("src", "http://127.0.0.1:18799", Role.BOTH),
        InstanceSettings("dst", dst.url, Role.BOTH, kv_events_endpoint=dst.kv_events_endpoint),
    )
    settings = replace(
        base,
        routing=replace(base.routing, block_size=BS),  # kvgate 16, the engine 32
        pools=(PoolSettings("vllm", Role.BOTH, insts, replication_sink=ReplicationSink.WARMUP),),
        replication=ReplicationSettings(timeout_s=60.0, hot_rate_per_s=0.01),
        server=replace(base.server, refit_interval_s=0),
    )
    prompt = VLLM_PREFIX + [7] * 8  # a partial block past the prefix: never cached
    raw = json.dumps({"model": dst.model, "prompt": prompt, "max_tokens": 4}).encode()
    hits_before = vllm_metric(dst.url, "vllm:prefix_cache_hits_total")

    entry, cmd, conductor = asyncio.run(copy_hot_prefix(settings, raw, engine_block=VLLM_BLOCK))
    assert cmd.tokens == len(VLLM_PREFIX) and len(cmd.block_hashes) == 33
    index = conductor.index
    confirmed = all(
        index.holds("dst", h) and not index.is_predicted("dst", h)
        for h in cmd.block_hashes[: VLLM_CACHEABLE // BS]
    )
    assert entry.state == "confirmed", entry
    assert confirmed
    after = complete(dst.url, VLLM_PREFIX + [9] * 40)
    hits_after = vllm_metric(dst.url, "vllm:prefix_cache_hits_total")
    assert hits_after - hits_before >= VLLM_CACHEABLE
    print(
        f"\nvLLM warm-up of {entry.tokens} tokens: {float(entry.latency_s) * 1e3:.1f} ms "
        f"to confirmation by KV events; destination vllm:prefix_cache_hits_total "
        f"{hits_before:.0f} -> {hits_after:.0f} after one request with the prefix "
        f"(usage {after['usage']})"
    )
