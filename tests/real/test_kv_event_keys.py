"""A real vLLM's KV events rebuild exactly the keys kvgate computes for the same prompts.

One vLLM 0.32 (CPU) with KV events over ipc://, engine block size 32 and a small KV pool
(``--num-gpu-blocks-override 96``). Token-id completions of 100, 300 and 700 tokens sharing
prefixes, a salted one and a chat request: for every full engine block, the keys kvgate
computes for the prompt (BlockHasher(16) and BlockHasher(32)) must equal the keys
``EngineKeyMap`` rebuilds from the engine's ``BlockStored`` events (100 %), the engine's own
block hashes must equal the emulator's recomputation of vLLM's hashing, and once the pool
overflows, the engine's ``BlockRemoved`` events must take exactly the evicted blocks' keys out
of the view (a real ``KVIndex``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from backends.engine_events import EngineBlockRemoved, EngineBlockStored, EngineEvent
from backends.engine_keys import EngineKeyMap
from backends.kv_events import KVEventSubscriber
from backends.model_files import load_prompt_encoder
from replay.emulator.vllm_hashing import block_digest, external_hash, none_hash
from routing.hashing import BlockHasher
from routing.kv_index import KVIndex
from routing.prompt_encoder import CHAT_PATH
from routing.tokenizer import pack_token_ids, unpack_token_ids
from routing.types import AllBlocksCleared
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine, wait_until

pytestmark = pytest.mark.real_engine

ENGINE_BS = 32
POOL_BLOCKS = 96
OWN_SIZES = (16, 32)
SALT = "tenant-7"


@pytest.fixture(scope="module")
def vllm_with_events(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    sock = tmp_path_factory.mktemp("kv-events") / "vllm.sock"
    (port,) = free_ports(1, 18200, 18300)
    proc = start_vllm(
        port,
        kv_events_endpoint=f"ipc://{sock}",
        block_size=ENGINE_BS,
        extra_args=["--num-gpu-blocks-override", str(POOL_BLOCKS), "--max-model-len", "2048"],
    )
    try:
        yield proc
    finally:
        stop_engine(proc)


def token_prompt(n: int, start: int) -> list[int]:
    """n ordinary token ids (clear of the tiny model's special tokens at the low ids)."""
    return [10 + (start + 7 * i) % 1900 for i in range(n)]


def vllm_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    """vLLM's event hashes of a prompt's full blocks; a salt is a tagged extra key of block 0."""
    digest, out = none_hash(), []
    for b in range(len(tokens) // ENGINE_BS):
        extra = (("cache_salt", salt),) if b == 0 and salt is not None else None
        digest = block_digest(digest, tokens[b * ENGINE_BS : (b + 1) * ENGINE_BS], extra)
        out.append(external_hash(digest))
    return out


@dataclass
class View:
    """What kvgate learns from the engine's events, at both gateway block sizes."""

    maps: dict[int, EngineKeyMap] = field(default_factory=dict)
    index: dict[int, KVIndex] = field(default_factory=dict)
    stored: list[EngineBlockStored] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    held: set[int] = field(default_factory=set)  # engine hashes stored and not removed since

    def __post_init__(self) -> None:
        for size in OWN_SIZES:
            self.maps[size] = EngineKeyMap(BlockHasher(size))
            self.index[size] = KVIndex()
            self.index[size].add_instance("vllm", 1 << 20)

    def on_events(self, _instance: str, events: list[EngineEvent]) -> None:
        for ev in events:
            if isinstance(ev, EngineBlockStored) and ev.group_idx == 0:
                self.stored.append(ev)
                self.held.update(ev.block_hashes)
            elif isinstance(ev, EngineBlockRemoved):
                self.removed.extend(ev.block_hashes)
                self.held.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.held.clear()
        for size, keys in self.maps.items():
            for own in keys.apply(events):
                self.index[size].apply("vllm", own, 0.0)

    def holds(self, size: int, keys: tuple[int, ...]) -> list[bool]:
        return [self.index[size].holds("vllm", k) for k in keys]


@dataclass(frozen=True)
class Prompt:
    name: str
    tokens: list[int]  # what the engine prefilled (kvgate's computation of it)
    salt: str | None = None

    def full_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) // ENGINE_BS * ENGINE_BS]

    def keys(self, size: int) -> tuple[int, ...]:
        """The keys kvgate computes for the prompt's full engine blocks."""
        hasher = BlockHasher(size)
        root = hasher.namespace_root(None, self.salt)
        return hasher.hash_packed(pack_token_ids(self.full_tokens()), root=root)


async def _post(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Any:
    async with s.post(url + path, json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return json.loads(text)


def _percent(hits: list[bool]) -> float:
    return 100.0 * sum(hits) / len(hits) if hits else 100.0


def test_engine_events_rebuild_kvgates_keys_and_evictions_remove_them(
    vllm_with_events: EngineProcess,
) -> None:
    engine = vllm_with_events
    assert engine.kv_events_endpoint is not None and engine.model_dir is not None
    encoder = load_prompt_encoder(engine.model_dir)
    base = token_prompt(700, 0)
    chat_body = {
        "model": engine.model,
        "messages": [
            {"role": "system", "content": "You answer with care. " * 30},
            {"role": "user", "content": "Which block size does this engine use?"},
        ],
    }
    chat_tokens = unpack_token_ids(encoder.encode(CHAT_PATH, chat_body).packed)
    prompts = [
        Prompt("completion-100", base[:100]),
        Prompt("completion-300", base[:300]),  # shares the first 100 tokens
        Prompt("completion-700", base),  # shares the first 300
        Prompt("salted-300", base[:300], salt=SALT),  # same tokens, its own namespace
        Prompt("chat", chat_tokens),
    ]
    view = View()
    report: dict[str, dict[str, float]] = {}

    async def main() -> None:
        stop = asyncio.Event()
        sub = KVEventSubscriber(engine.kv_events_endpoint, "vllm", view.on_events)
        task = asyncio.create_task(sub.run(stop))
        try:
            async with aiohttp.ClientSession() as s:
                await asyncio.sleep(0.5)  # ZMQ slow joiner: let the SUB connect first
                for p in prompts:
                    if p.name == "chat":
                        body = {**chat_body, "max_tokens": 1}
                        await _post(s, engine.url, "/v1/chat/completions", body)
                    else:
                        body = {"model": engine.model, "prompt": p.tokens, "max_tokens": 1}
                        if p.salt is not None:
                            body["cache_salt"] = p.salt
                        await _post(s, engine.url, "/v1/completions", body)
                    want = p.keys(OWN_SIZES[0])
                    await wait_until(lambda w=want: all(view.holds(OWN_SIZES[0], w)))
                    report[p.name] = {
                        f"match_pct_bs{size}": _percent(view.holds(size, p.keys(size)))
                        for size in OWN_SIZES
                    }
                # Fill the 96-block pool with unrelated prompts: the engine evicts.
                for i in range(6):
                    body = {"model": engine.model, "prompt": token_prompt(640, 5000 + 97 * i)}
                    await _post(s, engine.url, "/v1/completions", {**body, "max_tokens": 1})
                await wait_until(lambda: len(view.removed) >= 40)
                await asyncio.sleep(0.5)  # the last batch of events
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=5)

    asyncio.run(asyncio.wait_for(main(), timeout=240))
    print("\nkey match per prompt (full engine blocks):", json.dumps(report, indent=1))
    for name, row in report.items():
        assert row == {f"match_pct_bs{s}": 100.0 for s in OWN_SIZES}, (name, row)

    # The engine's own hashes are what the emulator computes as vLLM's (plain prompts).
    stored_names = {h for ev in view.stored for h in ev.block_hashes}
    for p in prompts:
        assert set(vllm_hashes(p.full_tokens(), p.salt)) <= stored_names, p.name

    # Evictions: every block the engine removed (and did not store again) left the view, and
    # every block it still holds is still there.
    assert view.removed, "the 96-block pool never evicted"
    for p in prompts:
        names = vllm_hashes(p.full_tokens(), p.salt)
        for size in OWN_SIZES:
            per_block = ENGINE_BS // size
            keys = p.keys(size)
            for b, name in enumerate(names):
                held = view.holds(size, keys[b * per_block : (b + 1) * per_block])
                assert held == [name in view.held] * per_block, (p.name, size, b)
    gone = [p.name for p in prompts if not set(vllm_hashes(p.tokens, p.salt)) <= view.held]
    print("prompts with evicted blocks:", gone, "removed engine blocks:", len(view.removed))
    assert gone, "no test prompt lost a block to eviction"
    assert all(m.stats.unknown_parent == 0 for m in view.maps.values())


GATEWAY_CONFIG = """
[server]
host = "127.0.0.1"
port = {port}
refit_interval_s = 0
[routing]
block_size = 16
model_dir = "{model_dir}"
# Low enough that the long chat and text prompts below are tokenized in a worker thread
# (gateway/tokenize_ahead.py): the keys must come out the same that way.
tokenize_offload_chars = 1000
[admission]
mode = "none"
[replication]
enabled = false
[[pools]]
name = "workers"
role = "both"
[[pools.instances]]
id = "v0"
url = "{url}"
protocol = "vllm"
kv_events_endpoint = "{endpoint}"
"""


def test_through_the_gateway_engine_events_carry_the_requests_keys(
    vllm_with_events: EngineProcess, tmp_path: Path
) -> None:
    """kvgate in front of the real vLLM: for chat and completion requests routed through it,
    and for a request sent to the engine directly, the keys the gateway rebuilds from the
    engine's events are the keys it computes for the prompts (gateway block size 16)."""
    import uvicorn

    from config.loader import load_settings
    from gateway.app import build_app

    engine = vllm_with_events
    config = tmp_path / "kvgate.toml"
    (port,) = free_ports(1, 18250, 18300)
    config.write_text(
        GATEWAY_CONFIG.format(
            port=port,
            model_dir=engine.model_dir,
            url=engine.url,
            endpoint=engine.kv_events_endpoint,
        )
    )
    app = build_app(load_settings(config))
    gw = app.gateway
    system = "You route prompts to the engine that has their prefix. " * 25
    requests = [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": "first question"}]}),
        ("/v1/completions", {"prompt": system + " and a text completion"}),
        ("/v1/completions", {"prompt": token_prompt(420, 77)}),
    ]  # fmt: skip
    direct = token_prompt(380, 31337)  # sent to the engine itself, not through kvgate
    report: dict[str, float] = {}

    def prompt_tokens(path: str, body: dict[str, Any]) -> list[int]:
        return unpack_token_ids(gw.prompt_encoder.encode(path, body).packed)

    def event_keys(tokens: list[int]) -> list[int]:
        keys = gw.kv_feeds.keys["v0"]
        return [k for h in vllm_hashes(tokens) for k in keys.keys_of(h)]

    async def main() -> None:
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
        )
        serve = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not serve.done(), "the gateway did not start"
                await asyncio.sleep(0.02)
            url = f"http://127.0.0.1:{port}"
            await asyncio.sleep(0.5)  # the gateway's SUB connects to the ipc:// endpoint
            async with aiohttp.ClientSession() as s:
                for i, (path, body) in enumerate(requests):
                    await _post(s, url, path, {**body, "model": engine.model, "max_tokens": 1})
                    tokens = prompt_tokens(path, body)
                    full = tokens[: len(tokens) // ENGINE_BS * ENGINE_BS]
                    want = list(gw.hasher.hash_tokens(full))
                    await wait_until(lambda f=full, w=want: event_keys(f) == w)
                    got = set(event_keys(full))
                    report[f"{i}:{path}"] = _percent([k in got for k in want])
                body = {"model": engine.model, "prompt": direct, "max_tokens": 1}
                await _post(s, engine.url, "/v1/completions", body)
                full = direct[: len(direct) // ENGINE_BS * ENGINE_BS]
                want = list(gw.hasher.hash_tokens(full))
                index = gw.conductor.index
                await wait_until(lambda w=want: all(index.holds("v0", k) for k in w))
                report["direct-to-engine"] = _percent([index.holds("v0", k) for k in want])
        finally:
            server.should_exit = True
            await asyncio.wait_for(serve, timeout=15)

    asyncio.run(asyncio.wait_for(main(), timeout=180))
    print("\ngateway: keys rebuilt from engine events, % of the request's keys:", report)
    assert report and all(v == 100.0 for v in report.values()), report
    assert gw.tokenizing.delivered == 2  # the chat and the text prompt, in a thread
    stats = gw.kv_feeds.keys["v0"].stats if "v0" in gw.kv_feeds.keys else None
    print("engine key map:", stats)
