"""The two P/D hand-offs between emulators: vLLM NIXL-style pull and SGLang bootstrap rooms.

vLLM (reference section 6.1): the prefill pins the prompt's KV and answers with
``kv_transfer_params``; the decode pulls it through the prefill's side channel
(``POST /internal/kv/pull``), which answers once the modelled transfer is over and unpins.
SGLang (section 6.2): both legs get the same ``bootstrap_room``; the prefill registers the
room when its prefill is done and the decode long-polls ``GET /bootstrap/room/{room}``, then
waits the modelled transfer itself. Pins and rooms expire after a wall-clock timeout, as
vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT frees KV a decode never pulled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from replay.emulator.openai_api import Bootstrap, RequestError
from replay.emulator.runtime import EngineRuntime
from replay.engine.network import Network

SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998  # --disaggregation-bootstrap-port default
_POLL_S = 10.0  # one bootstrap long-poll; the decode polls again until its timeout


@dataclass(slots=True)
class PinnedKV:
    request_id: str  # the id the decode names it by (remote_request_id / the room)
    prompt_tokens: int
    cached_tokens: int
    block_ids: list[int] = field(default_factory=list)


class PinnedStore:
    """KV a prefill holds for a decode that has not taken it yet, keyed by request id."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._items: dict[str, tuple[PinnedKV, asyncio.TimerHandle]] = {}

    def pin(self, entry: PinnedKV) -> None:
        self.take(entry.request_id)  # a reused id replaces the old pin
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self.take, entry.request_id)
        self._items[entry.request_id] = (entry, timer)

    def get(self, request_id: str) -> PinnedKV | None:
        item = self._items.get(request_id)
        return item[0] if item is not None else None

    def take(self, request_id: str) -> PinnedKV | None:
        item = self._items.pop(request_id, None)
        if item is None:
            return None
        item[1].cancel()
        return item[0]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def tokens(self) -> int:
        return sum(e.prompt_tokens for e, _ in self._items.values())

    def clear(self) -> None:
        for _, timer in self._items.values():
            timer.cancel()
        self._items.clear()


class BootstrapRooms:
    """SGLang prefill side: rooms whose prefill finished, long-polled by decodes.

    A decode may ask before the prefill has even received its leg (both are sent at once),
    so waiting creates the room; rooms nobody completes or claims expire.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._rooms: dict[int, tuple[asyncio.Future[PinnedKV], asyncio.TimerHandle]] = {}

    def _room(self, room: int) -> asyncio.Future[PinnedKV]:
        item = self._rooms.get(room)
        if item is None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(self.timeout_s, self._expire, room)
            item = (loop.create_future(), timer)
            self._rooms[room] = item
        return item[0]

    def _expire(self, room: int) -> None:
        item = self._rooms.pop(room, None)
        if item is not None:
            item[1].cancel()
            item[0].cancel()  # wakes any waiter; it reports a timeout

    def register(self, room: int, entry: PinnedKV) -> None:
        fut = self._room(room)
        if not fut.done():
            fut.set_result(entry)

    async def wait(self, room: int, timeout_s: float) -> PinnedKV | None:
        """The room's prefill, claimed (unpinned); None if not done within ``timeout_s``."""
        fut = self._room(room)
        # asyncio.wait never cancels the future: other waiters and the timer stay valid.
        done, _ = await asyncio.wait([fut], timeout=timeout_s)
        if not done or fut.cancelled():
            return None
        self._expire(room)  # claimed: the prefill's KV is free
        return fut.result()

    @property
    def pinned_tokens(self) -> int:
        return sum(
            f.result().prompt_tokens
            for f, _ in self._rooms.values()
            if f.done() and not f.cancelled()
        )

    def clear(self) -> None:
        for room in list(self._rooms):
            self._expire(room)


class TransferModel:
    """KV transfers over this instance's link, timed by replay.engine.network (with contention
    among the transfers this instance takes part in) and slept in scaled wall time."""

    def __init__(self, runtime: EngineRuntime, network: Network, kv_bytes_per_token: int) -> None:
        self.runtime = runtime
        self.network = network
        self.kv_bytes_per_token = kv_bytes_per_token

    async def transfer(self, source: str, destination: str, tokens: int) -> float:
        """Wait until ``tokens`` tokens of KV have moved; returns the model seconds it took."""
        now = self.runtime.now()
        end = self.network.transfer(source, destination, tokens * self.kv_bytes_per_token, now)
        await self.runtime.sleep_model(end - now)
        return end - now


def http_host(host: str) -> str:
    """Bracket a bare IPv6 address for a URL."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def _json(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = await resp.json(content_type=None)
    except (aiohttp.ContentTypeError, ValueError):
        data = None
    return data if isinstance(data, dict) else {}


def _error_message(data: dict[str, Any], status: int) -> str:
    err = data.get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return f"HTTP {status}"


async def pull_kv(
    session: aiohttp.ClientSession, params: dict[str, Any], destination: str
) -> PinnedKV:
    """Decode side of the vLLM protocol: pull the pinned KV from the prefill's side channel."""
    host, port = params.get("remote_host"), params.get("remote_port")
    rid = params.get("remote_request_id")
    if not isinstance(host, str) or not isinstance(port, int) or not isinstance(rid, str):
        raise RequestError(
            400,
            "kv_transfer_params needs remote_host, remote_port and remote_request_id",
            "kv_transfer_params",
        )
    url = f"http://{http_host(host)}:{port}/internal/kv/pull"
    body = {
        "remote_request_id": rid,
        "remote_engine_id": params.get("remote_engine_id"),
        "destination": destination,
    }
    try:
        async with session.post(url, json=body) as resp:
            data = await _json(resp)
            if resp.status != 200:
                msg = _error_message(data, resp.status)
                raise RequestError(502, f"KV pull from {host}:{port} failed: {msg}")
    except aiohttp.ClientError as exc:
        raise RequestError(502, f"KV pull from {host}:{port} failed: {exc}") from exc
    return PinnedKV(rid, int(data.get("prompt_tokens", 0)), int(data.get("cached_tokens", 0)))


async def wait_room(
    session: aiohttp.ClientSession, boot: Bootstrap, timeout_s: float
) -> tuple[PinnedKV, str]:
    """Decode side of the SGLang protocol: the room's prefill and the prefill's engine id."""
    port = boot.port if boot.port is not None else SGLANG_DEFAULT_BOOTSTRAP_PORT
    url = f"http://{http_host(boot.host)}:{port}/bootstrap/room/{boot.room}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (left := deadline - loop.time()) > 0:
        try:
            async with session.get(url, params={"timeout_s": f"{min(left, _POLL_S):.3f}"}) as resp:
                data = await _json(resp)
                if resp.status == 200:
                    entry = PinnedKV(
                        str(boot.room),
                        int(data.get("prompt_tokens", 0)),
                        int(data.get("cached_tokens", 0)),
                    )
                    return entry, str(data.get("engine_id", f"{boot.host}:{port}"))
                if resp.status != 408:
                    msg = _error_message(data, resp.status)
                    raise RequestError(502, f"bootstrap {boot.host}:{port} failed: {msg}")
        except aiohttp.ClientError as exc:
            raise RequestError(502, f"bootstrap {boot.host}:{port} failed: {exc}") from exc
    raise RequestError(
        504, f"KV transfer for bootstrap_room={boot.room} timed out in WaitingForInput"
    )
