"""The tiny llama.cpp test fleet: token-id prompts (kvgate and the engine count them alike) and
the gateway settings in front of real llama-servers."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from config.settings import EngineKind, InstanceSettings, PoolSettings, Role, Settings
from tests.real.engines import EngineProcess

VOCAB_HI = 7000  # below the tiny GGUF's 8000-token vocabulary (ids past it are refused)


def token_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB_HI) for _ in range(n)]


def llama_settings(engines: list[EngineProcess], **routing: Any) -> Settings:
    """kvcache_centric over ``engines`` (ids l0, l1, ...), blocks of 16, a fast /slots scrape,
    no refits, no host-cache probe (the engines run --cache-ram 0, and the probe's prompts
    would overwrite the slots a test fills); ``routing`` overrides more routing settings."""
    base = Settings()
    instances = tuple(
        InstanceSettings(f"l{i}", e.url, Role.BOTH, engine=EngineKind.LLAMACPP)
        for i, e in enumerate(engines)
    )
    return replace(
        base,
        routing=replace(
            base.routing,
            policy="kvcache_centric",
            block_size=16,
            **{"llamacpp_host_cache_probe": False, **routing},
        ),
        pools=(PoolSettings("llama", Role.BOTH, instances),),
        server=replace(base.server, scrape_interval_s=0.2, refit_interval_s=0),
    )
