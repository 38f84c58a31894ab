"""llama.cpp slot files (gateway/slot_files.py, backends/llamacpp_slot_api.py) against real
llama-servers started with ``--slot-save-path``: a shared prefix overwritten in the engine's only
slot comes back from its file instead of being recomputed, and a file one engine saved loads
into another that shares the directory, and a restarted gateway takes over the files the last
one saved.

One engine, one slot: A twice (A is now shared; kvgate saves the slot once the second request
finishes), then a cold B overwrites the slot, then A again: with slot files the engine reports
A's tokens cached (kvgate loaded the file into the slot first); without them (the control arm)
it recomputes A. Prompts are token ids from the tiny model's vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from backends.llamacpp_slot_api import SlotFileError, restore_slot, save_slot
from gateway.app import GatewayApp, build_app
from tests.gateway.live import serving
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_llama_server, stop_engine
from tests.real.llama_fleet import llama_settings, token_ids

pytestmark = pytest.mark.real_engine

PREFIX = 640  # tokens of A: 40 blocks of 16


@pytest.fixture
def llamas(llamacpp_install: EngineInstall, tmp_path: Path) -> Iterator[list[EngineProcess]]:
    """Two fresh one-slot engines sharing one save directory (``tmp_path``)."""
    engines: list[EngineProcess] = []
    try:
        for port in free_ports(2, 18850, 18900):
            engines.append(
                start_llama_server(
                    port,
                    slots=1,
                    ctx=2048,
                    cache_ram_mib=0,
                    extra_args=("--slot-save-path", str(tmp_path)),
                )
            )
        yield engines
    finally:
        for e in engines:
            stop_engine(e)


async def _send(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
    """The tokens the engine found cached for the prompt."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _sequence(engine: EngineProcess, save_path: Path | None) -> dict[str, int]:
    a, b = token_ids(1, PREFIX), token_ids(2, PREFIX)
    app = build_app(
        llama_settings(
            [engine], llamacpp_slot_save_path=None if save_path is None else str(save_path)
        )
    )
    async with serving(app) as url, aiohttp.ClientSession() as s:
        await _slots_read(app)
        seen = {}
        seen["a1"] = await _send(s, url, a + token_ids(11, 16))
        seen["a2"] = await _send(s, url, a + token_ids(12, 16))  # A is shared now
        if save_path is not None:
            await _one_file_saved(app)
        seen["b"] = await _send(s, url, b + token_ids(13, 16))  # overwrites the only slot
        seen["a3"] = await _send(s, url, a + token_ids(14, 16))
        assert app.gateway.slot_book.held == 0
        seen["restored"] = await _slot_file_events(s, url, "restored")
        return seen


async def _slots_read(app: GatewayApp) -> None:
    book = app.gateway.slot_book
    for _ in range(200):  # the slot layout comes with the first /slots scrape
        if "l0" in book.instances:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("llama-server /slots never read")


async def _one_file_saved(app: GatewayApp) -> None:
    files = app.gateway.slot_files
    assert files is not None
    for _ in range(200):  # saved once the second request finished
        if files.saved:
            break
        await asyncio.sleep(0.05)
    assert len(files.saved) == 1, "no slot file saved"


async def _slot_file_events(s: aiohttp.ClientSession, url: str, event: str) -> int:
    metrics = await (await s.get(url + "/metrics")).text()
    return int(_counter(metrics, f'kvgate_llamacpp_slot_files_total{{event="{event}"}}'))


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("files", [True, False], ids=["slot_files", "control"])
def test_an_overwritten_shared_prefix_comes_back_from_its_slot_file(
    llamas: list[EngineProcess], tmp_path: Path, files: bool
) -> None:
    seen = asyncio.run(_sequence(llamas[0], tmp_path if files else None))
    assert seen["a2"] >= PREFIX - 16, seen  # the engine reused A from its slot
    assert seen["b"] < 16, seen
    if files:
        assert len(list(tmp_path.glob("kvgate-*.bin"))) == 1
        assert seen["restored"] == 1, seen
        assert seen["a3"] >= PREFIX - 16, seen  # loaded from the file, not recomputed
    else:
        assert not list(tmp_path.glob("kvgate-*.bin"))
        assert seen["a3"] < PREFIX // 2, seen


def test_a_restarted_gateway_takes_over_the_files_the_last_one_saved(
    llamas: list[EngineProcess], tmp_path: Path
) -> None:
    """Gateway 1 saves A; a client overwrites the engine's only slot directly; gateway 2, on
    the same directory, knows A's file from its key sidecar and loads it for A's next request
    instead of recomputing A."""
    a, b = token_ids(1, PREFIX), token_ids(2, PREFIX)
    engine = llamas[0]

    async def run() -> dict[str, int]:
        seen = {}
        async with aiohttp.ClientSession() as s:
            first = build_app(llama_settings([engine], llamacpp_slot_save_path=str(tmp_path)))
            async with serving(first) as url:
                await _slots_read(first)
                await _send(s, url, a + token_ids(11, 16))
                await _send(s, url, a + token_ids(12, 16))
                await _one_file_saved(first)
            seen["b"] = await _send(s, engine.url, b + token_ids(13, 16))  # not through kvgate
            second = build_app(llama_settings([engine], llamacpp_slot_save_path=str(tmp_path)))
            async with serving(second) as url:
                await _slots_read(second)
                seen["adopted"] = await _slot_file_events(s, url, "adopted")
                seen["a"] = await _send(s, url, a + token_ids(14, 16))
                seen["restored"] = await _slot_file_events(s, url, "restored")
                seen["saved"] = await _slot_file_events(s, url, "saved")
        return seen

    seen = asyncio.run(run())
    assert seen["b"] < 16, seen  # A was gone from the slot
    assert seen["adopted"] == 1 and seen["restored"] == 1, seen
    assert seen["a"] >= PREFIX - 16, seen  # loaded from the file, not recomputed
    assert seen["saved"] == 0, seen  # the prefix has its file: not saved again


def test_a_file_one_engine_saved_loads_into_another_sharing_the_directory(
    llamas: list[EngineProcess],
) -> None:
    """What cross-engine restores rest on, asked of the engines themselves."""
    a = token_ids(1, PREFIX)

    async def in_slot_0(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> int:
        """The engine's own ``cache_n`` for ``prompt`` run in slot 0."""
        body = {"prompt": prompt, "n_predict": 2, "id_slot": 0, "cache_prompt": True}
        async with s.post(url + "/completion", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["timings"]["cache_n"]

    async def run() -> tuple[int, int, int]:
        async with aiohttp.ClientSession() as s:
            await in_slot_0(s, llamas[0].url, a + token_ids(21, 16))
            saved = await save_slot(s, llamas[0].url, 0, "shared-a.bin", 30.0)
            restored = await restore_slot(s, llamas[1].url, 0, "shared-a.bin", 30.0)
            cached = await in_slot_0(s, llamas[1].url, a + token_ids(22, 16))
            return saved.tokens, restored.tokens, cached

    saved, restored, cached = asyncio.run(run())
    assert saved == restored >= PREFIX + 16
    assert cached >= PREFIX  # l1 computed none of A


def test_a_refused_restore_is_a_clear_error(llamas: list[EngineProcess]) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            await restore_slot(s, llamas[0].url, 0, "no-such-file.bin", 30.0)

    with pytest.raises(SlotFileError, match="restore slot 0") as refused:
        asyncio.run(run())
    assert refused.value.bad_file  # HTTP 400: kvgate drops such a file (gateway/slot_files.py)
