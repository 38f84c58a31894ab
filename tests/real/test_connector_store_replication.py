"""Replication through the store the engines' own KV connector shares: two real vLLMs whose
ExampleConnector (``kv_role`` kv_both) writes and reads one directory. A prefix made hot on the
first reaches the second through the gateway's ``connector_store`` sink: the source writes the
prefix to the store, the destination *loads* it from there (its own
``vllm:external_prefix_cache_hits_total`` counts the tokens) instead of computing it, and its KV
events confirm the copy in kvgate's index; the next request with the prefix hits its cache.

Prompts are token ids from the tiny model's vocabulary (no tokenizer needed)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from config.settings import (
    InstanceSettings,
    PoolSettings,
    ReplicationSettings,
    ReplicationSink,
    Role,
    Settings,
)
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, stop_engine
from tests.real.pd_harness import prompt_tokens_by_source, start_pair
from tests.real.replication_harness import complete, copy_hot_prefix, vllm_metric

pytestmark = pytest.mark.real_engine

BS = 16  # kvgate's block size; the engines' is 32
ENGINE_BLOCK = 32
PREFIX = [random.Random(7).randrange(100, 4000) for _ in range(32 * BS)]  # 512 tokens
# ExampleConnector loads whole engine blocks up to the prompt's last token: 480 of 512 here.
LOADABLE = (len(PREFIX) - 2) // ENGINE_BLOCK * ENGINE_BLOCK


def _store_args(directory: str) -> list[str]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": directory},
    }
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture
def store_pair(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    tmp = tmp_path_factory.mktemp("connector-store")
    args = _store_args(str(tmp / "kv"))
    src_port, dst_port = free_ports(2, 18730, 18799)
    events = (None, f"ipc://{tmp / 'dst-events.sock'}")
    src, dst = start_pair((src_port, dst_port), (args, args), kv_events=events, timeout_s=360)
    yield src, dst
    stop_engine(dst)
    stop_engine(src)


def test_a_hot_prefix_reaches_the_second_engine_through_the_connectors_store(store_pair) -> None:
    src, dst = store_pair
    for i in range(2):  # hot on the source (its connector stores these whole prompts)
        complete(src.url, PREFIX + [11 + i] * 40)
    external_before = vllm_metric(dst.url, "vllm:external_prefix_cache_hits_total")
    computed_before = prompt_tokens_by_source(dst).get("local_compute", 0.0)
    hits_before = vllm_metric(dst.url, "vllm:prefix_cache_hits_total")
    insts = (
        InstanceSettings("src", src.url, Role.BOTH),
        InstanceSettings("dst", dst.url, Role.BOTH, kv_events_endpoint=dst.kv_events_endpoint),
    )
    base = Settings()
    settings = replace(
        base,
        routing=replace(base.routing, block_size=BS),
        pools=(
            PoolSettings(
                "vllm", Role.BOTH, insts, replication_sink=ReplicationSink.CONNECTOR_STORE
            ),
        ),
        replication=ReplicationSettings(timeout_s=90.0, hot_rate_per_s=0.01),
        server=replace(base.server, refit_interval_s=0),
    )
    raw = json.dumps({"model": dst.model, "prompt": PREFIX + [7] * 8, "max_tokens": 4}).encode()

    entry, cmd, conductor = asyncio.run(copy_hot_prefix(settings, raw, engine_block=ENGINE_BLOCK))
    held = conductor.index.holds("dst", cmd.prefix_key)
    assert (entry.sink, entry.state) == ("connector_store", "confirmed"), entry
    assert held
    loaded = vllm_metric(dst.url, "vllm:external_prefix_cache_hits_total") - external_before
    assert loaded >= LOADABLE  # the destination loaded the prefix from the store
    computed = prompt_tokens_by_source(dst).get("local_compute", 0.0) - computed_before
    assert computed <= len(PREFIX) - LOADABLE  # ... and computed only the rest
    after = complete(dst.url, PREFIX + [9] * 40)
    t0 = time.perf_counter()  # for scale: a cold prompt of the prefix's size on the destination
    complete(dst.url, [random.Random(8).randrange(100, 4000) for _ in range(len(PREFIX))])
    cold_ms = (time.perf_counter() - t0) * 1e3
    hits = vllm_metric(dst.url, "vllm:prefix_cache_hits_total") - hits_before
    assert hits >= len(PREFIX)  # ... and the next request with it hits its own cache
    print(
        f"\nconnector-store copy of {entry.tokens} tokens: {float(entry.latency_s) * 1e3:.1f} ms "
        f"to confirmation by KV events; destination loaded {loaded:.0f} tokens from the store "
        f"(external_prefix_cache_hits_total), computed {computed:.0f}; next request: "
        f"prefix_cache_hits +{hits:.0f}, "
        f"usage {after['usage']}; a cold {len(PREFIX)}-token prompt there: {cold_ms:.1f} ms"
    )
