"""A gateway that crashed and restarts rebuilds its cache view from the real engine: vLLM's
KV event replay buffer holds what the engine cached while no gateway listened (issue 12,
graceful restarts: "after a crash, a new process rebuilds its view from the engines")."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import uvicorn

from config.loader import load_settings
from gateway.app import build_app
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine, wait_until
from tests.real.pd_harness import KvgateProcess
from tests.real.test_kv_event_keys import (
    ENGINE_BS,
    GATEWAY_CONFIG,
    _post,
    token_prompt,
)

pytestmark = pytest.mark.real_engine

# test_kv_event_keys' gateway, plus the engine's replay socket.
CONFIG = GATEWAY_CONFIG + 'kv_events_replay_endpoint = "{replay}"\n'


@pytest.fixture(scope="module")
def vllm_with_replay(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineProcess, str]]:
    tmp = tmp_path_factory.mktemp("kv-replay")
    replay = f"ipc://{tmp / 'replay.sock'}"
    (port,) = free_ports(1, 18300, 18340)
    proc = start_vllm(
        port,
        kv_events_endpoint=f"ipc://{tmp / 'events.sock'}",
        kv_events_replay_endpoint=replay,
        block_size=ENGINE_BS,
        extra_args=["--max-model-len", "2048"],
    )
    try:
        yield proc, replay
    finally:
        stop_engine(proc)


def test_a_restarted_gateway_knows_what_the_engine_cached_before(
    vllm_with_replay: tuple[EngineProcess, str], tmp_path: Path
) -> None:
    engine, replay = vllm_with_replay
    assert engine.kv_events_endpoint is not None
    gw_a, gw_b = free_ports(2, 18340, 18380)

    def config(port: int) -> str:
        return CONFIG.format(
            port=port,
            model_dir=engine.model_dir,
            url=engine.url,
            endpoint=engine.kv_events_endpoint,
            replay=replay,
        )

    through_a = token_prompt(400, 501)  # cached through the first gateway
    direct = token_prompt(300, 9001)  # cached while no gateway ran

    async def send(url: str, prompt: list[int]) -> None:
        async with aiohttp.ClientSession() as s:
            body = {"model": engine.model, "prompt": prompt, "max_tokens": 1}
            await _post(s, url, "/v1/completions", body)

    a = KvgateProcess(tmp_path, "kvgate-a", gw_a, config(gw_a))
    try:
        asyncio.run(send(a.url, through_a))
    finally:
        a.proc.send_signal(signal.SIGKILL)  # a crash: no drain, no goodbye
        a.proc.wait(10)
    asyncio.run(send(engine.url, direct))

    app = build_app(load_settings(_write(tmp_path / "b.toml", config(gw_b))))
    gw = app.gateway

    def keys(prompt: list[int]) -> list[int]:
        full = prompt[: len(prompt) // ENGINE_BS * ENGINE_BS]
        return list(gw.hasher.hash_tokens(full))

    async def main() -> tuple[bool, int]:
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=gw_b, log_level="warning", lifespan="on")
        )
        serve = asyncio.create_task(server.serve())
        try:
            index = gw.conductor.index
            want = keys(through_a) + keys(direct)
            # No request reaches the engine meanwhile: only its replay buffer can tell.
            ok = await wait_until(lambda: all(index.holds("v0", k) for k in want), 20)
            sub = gw.kv_feeds.subscribers["v0"]
            return ok, sub.stats.caught_up
        finally:
            server.should_exit = True
            await asyncio.wait_for(serve, timeout=15)

    ok, caught_up = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert ok, "the restarted gateway's view lacks blocks the engine cached before it started"
    assert caught_up >= 2  # at least the two prompts' batches came from the replay buffer


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
