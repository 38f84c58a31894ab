"""The emulator's HTTP server (aiohttp) and its in-process API.

Public endpoints are the ones a vLLM / SGLang server has: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/models``, ``/health``, ``/metrics``,
``/reset_prefix_cache``.
Emulator-internal ones model what the engines do off HTTP:
- ``POST /internal/kv/pull`` - vLLM NIXL side channel: a decode pulls a pinned prompt's KV;
- ``GET /bootstrap/room/{room}`` - SGLang bootstrap: long-poll until the room's prefill is done;
- ``POST /internal/kv/fetch`` - replication "engine pull": copy blocks from a peer into the
  prefix cache (the peer is not contacted; only the link time is modelled);
- ``GET /internal/state`` - a JSON snapshot for tests and debugging.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from replay.emulator.batch_serving import completions
from replay.emulator.config import EmulatorConfig
from replay.emulator.kv_publisher import KVEventPublisher
from replay.emulator.openai_api import RequestError
from replay.emulator.pd import http_host
from replay.emulator.serving import (
    STATE_KEY,
    chat_completions,
    error_response,
    responses,
)
from replay.emulator.state import EmulatorState, build_state
from replay.emulator.vllm_hashing import PLAIN, BlockNamespace

_MAX_POLL_S = 60.0


def _state(request: web.Request) -> EmulatorState:
    return request.app[STATE_KEY]


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise RequestError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


async def models(request: web.Request) -> web.Response:
    st = _state(request)
    base = st.config.served_model
    card = {
        "id": base,
        "object": "model",
        "created": 0,
        "owned_by": "kvgate-emulator",
        "root": st.config.profile,
        "parent": None,
        "max_model_len": st.max_model_len,
    }
    # vLLM lists each LoRA adapter after the base model, its root the adapter's path.
    cards = [{**card, "id": name} for name in st.config.served_names] + [
        {**card, "id": name, "root": space.lora_path, "parent": base, "max_model_len": None}
        for name, space in st.adapters.items()
    ]
    return web.json_response({"object": "list", "data": cards})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)  # vLLM: empty 200


async def metrics(request: web.Request) -> web.Response:
    st = _state(request)
    body = st.metrics.render(st.load())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    _state(request).reset_prefix_cache()
    return web.Response(status=200)


async def internal_state(request: web.Request) -> web.Response:
    st = _state(request)
    load = st.load()
    cache = st.engine.cache
    return web.json_response(
        {
            "engine_id": st.config.engine_id,
            "role": st.config.role.value,
            "protocol": st.config.protocol.value,
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": load.kv_usage,
            "inflight": st.runtime.inflight,
            "pinned": len(st.pinned),
            "cached_blocks": len(cache) if cache is not None else 0,
            "model_time_s": st.runtime.now(),
        }
    )


async def kv_pull(request: web.Request) -> web.Response:
    """vLLM side channel: transfer a pinned prompt's KV to the caller, then unpin it."""
    st = _state(request)
    try:
        body = await _json_object(request)
        rid = body.get("remote_request_id")
        engine_id = body.get("remote_engine_id")
        if not isinstance(rid, str):
            raise RequestError(400, "remote_request_id must be a string", "remote_request_id")
        if engine_id is not None and engine_id != st.config.engine_id:
            raise RequestError(
                404, f"this instance is engine {st.config.engine_id}, not {engine_id}"
            )
        entry = st.pinned.get(rid)
        if entry is None:
            raise RequestError(404, f"no KV pinned for request {rid!r} (never, pulled or expired)")
    except RequestError as exc:
        return error_response(exc, {})
    destination = str(body.get("destination") or request.remote or "peer")
    try:
        seconds = await st.transfers.transfer(st.config.engine_id, destination, entry.prompt_tokens)
    finally:
        # Unpinned even when the decode gave up mid-transfer: it will not ask again.
        st.pinned.take(rid)
    return web.json_response(
        {
            "ok": True,
            "prompt_tokens": entry.prompt_tokens,
            "cached_tokens": entry.cached_tokens,
            "blocks": len(entry.block_ids),
            "bytes": entry.prompt_tokens * st.transfers.kv_bytes_per_token,
            "transfer_s": seconds,
        }
    )


async def bootstrap_room(request: web.Request) -> web.Response:
    """SGLang bootstrap: answers when the room's prefill is done (claiming it), else 408."""
    st = _state(request)
    try:
        room = int(request.match_info["room"])
        timeout = min(float(request.query.get("timeout_s", "10")), _MAX_POLL_S)
    except ValueError:
        return error_response(RequestError(400, "room and timeout_s must be numbers"), {})
    entry = await st.rooms.wait(room, max(timeout, 0.0))
    if entry is None:
        return error_response(RequestError(408, f"bootstrap_room={room} is not ready"), {})
    body = {
        "room": room,
        "prompt_tokens": entry.prompt_tokens,
        "cached_tokens": entry.cached_tokens,
        "engine_id": st.config.engine_id,
    }
    return web.json_response(body)


async def kv_fetch(request: web.Request) -> web.Response:
    """Replication: model the copy from ``source_url`` over the link, then cache the blocks."""
    st = _state(request)
    try:
        body = await _json_object(request)
        source, hashes, tokens = (
            body.get("source_url"),
            body.get("block_hashes"),
            body.get("tokens"),
        )
        if not isinstance(source, str) or not source:
            raise RequestError(400, "source_url must be a string", "source_url")
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise RequestError(400, "block_hashes must be a list of integers", "block_hashes")
        if tokens is None:
            tokens = len(hashes) * st.config.block_size
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise RequestError(400, "tokens must be a non-negative integer", "tokens")
    except RequestError as exc:
        return error_response(exc, {})
    await st.transfers.transfer(source, st.config.engine_id, tokens)
    blocks = tuple(hashes)
    if st.engine.cache is not None and blocks:
        # The copy's token ids (and the adapter / salt they were hashed under) travel with it,
        # for this instance's KV events, as vLLM's.
        token_ids, space = None, PLAIN
        if st.publisher is not None:
            token_ids, space = await _source_tokens(st, source, blocks)
        st.engine.cache.insert(blocks)
        st.runtime.publish_cache_events([_Fetched(blocks, token_ids, space)])
    return web.json_response({"ok": True, "blocks": len(blocks)})


async def _source_tokens(
    st: EmulatorState, source: str, blocks: tuple[int, ...]
) -> tuple[list[int] | None, BlockNamespace]:
    """The source instance's token ids of ``blocks`` (None when it does not know them all)
    and the namespace they were hashed in."""
    if st.session is None:
        return None, PLAIN
    url = source.rstrip("/") + "/internal/kv/tokens"
    try:
        async with st.session.post(url, json={"block_hashes": list(blocks)}) as r:
            body = await r.json() if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None, PLAIN
    token_ids = body.get("token_ids") if isinstance(body, dict) else None
    if not isinstance(token_ids, list):
        return None, PLAIN
    lora, salt = body.get("lora_name"), body.get("cache_salt")
    adapter = st.adapters.get(lora) if isinstance(lora, str) else None
    if adapter is None and isinstance(lora, str):  # not loaded here: the source's own path
        path = body.get("lora_path")
        adapter = BlockNamespace(lora, path if isinstance(path, str) else lora)
    space = adapter or PLAIN
    return token_ids, replace(space, cache_salt=salt if isinstance(salt, str) else None)


async def kv_tokens(request: web.Request) -> web.Response:
    """The token ids of cached blocks, for an instance copying them (null if any is unknown)."""
    st = _state(request)
    try:
        hashes = (await _json_object(request)).get("block_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, int) for h in hashes):
            raise RequestError(400, "block_hashes must be a list of integers", "block_hashes")
    except RequestError as exc:
        return error_response(exc, {})
    if st.publisher is None:
        return web.json_response({"token_ids": None})
    known = st.publisher.hashes.tokens_of(hashes)
    space = st.publisher.hashes.space_of(hashes) if known is not None else None
    if space is None:  # mixed namespaces: no single copy event could say them
        return web.json_response({"token_ids": None})
    answer = {"token_ids": known, "lora_name": space.lora_name, "lora_path": space.lora_path}
    return web.json_response({**answer, "cache_salt": space.cache_salt})


@dataclass(frozen=True, slots=True)
class _Fetched:
    """A fetched prefix as the KV event encoder sees prompts (tokens None when unknown)."""

    block_hashes: tuple[int, ...]
    token_ids: list[int] | None = None
    space: BlockNamespace = PLAIN


def build_app(state: EmulatorState) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # long token-id prompts
    app[STATE_KEY] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/internal/kv/pull", kv_pull)
    app.router.add_post("/internal/kv/fetch", kv_fetch)
    app.router.add_post("/internal/kv/tokens", kv_tokens)
    app.router.add_get("/internal/state", internal_state)
    app.router.add_get("/bootstrap/room/{room}", bootstrap_room)
    return app


async def _listen(host: str, port: int) -> socket.socket:
    """A bound socket, so port 0 can be reported as the real port before serving."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(eq=False, slots=True)
class RunningEmulator:
    config: EmulatorConfig
    state: EmulatorState
    runner: web.AppRunner
    port: int
    bootstrap_port: int | None

    @property
    def url(self) -> str:
        return f"http://{http_host(self.config.host)}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        pub = self.state.publisher
        return pub.endpoint if pub is not None else None

    async def stop(self) -> None:
        st = self.state
        await st.runtime.stop()  # fails streams still running, so handlers end at once
        st.rooms.clear()
        await self.runner.cleanup()
        st.pinned.clear()
        if st.session is not None:
            await st.session.close()
        if st.publisher is not None:
            st.publisher.close()


async def start_emulator(config: EmulatorConfig) -> RunningEmulator:
    """Build, bind and start one emulated instance (port 0 = ephemeral; see ``.port``)."""
    state = build_state(config)
    sock = await _listen(config.host, config.port)
    boot_sock = None
    try:
        if config.bootstrap_port is not None:
            boot_sock = await _listen(config.host, config.bootstrap_port)
        if config.kv_events_port is not None:
            state.publisher = KVEventPublisher(
                config.host,
                config.kv_events_port,
                topic=config.kv_events_topic,
                fmt=config.kv_events_format,
                block_size=config.block_size,
            )
            state.runtime.on_cache_events = state.publisher.publish
    except BaseException:
        sock.close()
        if boot_sock is not None:
            boot_sock.close()
        raise
    state.port = sock.getsockname()[1]
    boot_port = boot_sock.getsockname()[1] if boot_sock is not None else None
    # Handler cancellation: a client that disconnects cancels its handler, whose cleanup
    # takes the request out of the engine (what vLLM does on abort).
    runner = web.AppRunner(
        build_app(state), handler_cancellation=True, shutdown_timeout=2.0, access_log=None
    )
    await runner.setup()
    state.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10))
    state.runtime.start()
    await web.SockSite(runner, sock).start()
    if boot_sock is not None:
        # The same app on a second port: SGLang's bootstrap server lives on its own port.
        await web.SockSite(runner, boot_sock).start()
    return RunningEmulator(config, state, runner, state.port, boot_port)
