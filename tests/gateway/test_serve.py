"""gateway/serve.py: how kvgate's HTTP servers keep idle client connections.

A server that closes an idle keep-alive connection races the client's next request on it: the
request is reset and lost (Envoy answers 503; aiohttp does not retry a POST). So the side in
front must close first, which needs the server's keep-alive longer than the client's (uvicorn's
own default, 5 s, equals httpx's)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from config.errors import KvgateError
from config.loader import load_settings
from config.settings import KEEP_ALIVE_S, ServerSettings, Settings
from gateway.serve import server_config, start_server


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _open_after(port: int, idle_s: float) -> bool:
    """Whether a keep-alive connection is still open ``idle_s`` after its one request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
    await asyncio.sleep(idle_s)
    try:
        return await asyncio.wait_for(reader.read(1), 0.2) != b""  # b"": the server closed it
    except TimeoutError:
        return True
    finally:
        writer.close()


def test_start_server_keeps_an_idle_connection_for_keep_alive_s() -> None:
    async def run() -> tuple[bool, bool]:
        short = await start_server(_ok, "127.0.0.1", 0, keep_alive_s=0.3)
        default = await start_server(_ok, "127.0.0.1", 0)
        try:
            return await _open_after(short.port, 1.0), await _open_after(default.port, 1.0)
        finally:
            await short.stop()
            await default.stop()

    assert asyncio.run(run()) == (False, True)


def test_kvgate_serve_takes_keep_alive_s_from_its_settings() -> None:
    settings = Settings()
    assert settings.server.keep_alive_s == KEEP_ALIVE_S > 60  # beyond common LB idle timeouts
    settings = replace(settings, server=ServerSettings(keep_alive_s=12.5))
    config = server_config(_ok, settings, "127.0.0.1", 0, "warning")  # type: ignore[arg-type]
    assert config.timeout_keep_alive == 12.5


def test_keep_alive_s_must_be_positive(tmp_path: Path) -> None:
    path = tmp_path / "k.toml"
    path.write_text(
        '[server]\nkeep_alive_s = 0\n[[pools]]\nname = "w"\nrole = "both"\n'
        '[[pools.instances]]\nid = "w0"\nurl = "http://127.0.0.1:1"\n'
    )
    with pytest.raises(KvgateError, match="keep_alive_s"):
        load_settings(path)
