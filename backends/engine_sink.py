"""Engine-pull replication sink: tell the destination engine to fetch blocks from the source.

``POST {destination}/internal/kv/fetch {"source_url", "block_hashes", "tokens"}``; the engine
(kvgate's emulator implements it) models the transfer over its link, then holds the blocks and
publishes KV events for them. A copy counts as done only when the engine answers ok.
Transport errors are retried up to ``max_retries`` times here (the sink contract in
``backends/replication.py``); a timeout is reported as such (the copy may still land).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import aiohttp

from backends.replication import Outcome, ReplicationResult
from routing.types import ReplicationCommand


class UrlLookup(Protocol):
    def get(self, instance_id: str) -> str | None: ...


class EngineFetchSink:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: UrlLookup,
        *,
        kv_bytes_per_token: Mapping[str, int],
        timeout_s: float = 30.0,
        max_retries: int = 2,
    ) -> None:
        self._session = session
        self._urls = urls  # live view of instance id -> base URL
        self._kv_bytes = kv_bytes_per_token
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        start = time.perf_counter()
        dest = self._urls.get(cmd.destination)
        source = self._urls.get(cmd.source)
        if dest is None or source is None:
            return ReplicationResult(
                cmd.command_id, Outcome.NOT_EXECUTED, error="unknown source or destination instance"
            )
        body = {
            "source_url": source,
            "block_hashes": list(cmd.block_hashes),
            "tokens": cmd.tokens,
            "command_id": cmd.command_id,
        }
        error = None
        for attempt in range(1, self.max_retries + 2):
            try:
                async with self._session.post(
                    dest + "/internal/kv/fetch",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as resp:
                    payload = await resp.json(content_type=None)
                    if resp.status == 200 and isinstance(payload, dict) and payload.get("ok"):
                        nbytes = cmd.tokens * self._kv_bytes.get(cmd.destination, 0)
                        return ReplicationResult(
                            cmd.command_id,
                            Outcome.OK,
                            time.perf_counter() - start,
                            nbytes,
                            attempts=attempt,
                        )
                    error = f"HTTP {resp.status}: {payload}"
            except TimeoutError:
                return ReplicationResult(
                    cmd.command_id,
                    Outcome.TIMEOUT,
                    time.perf_counter() - start,
                    error="timeout",
                    attempts=attempt,
                )
            except (aiohttp.ClientError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        return ReplicationResult(
            cmd.command_id,
            Outcome.FAILED,
            time.perf_counter() - start,
            error=error,
            attempts=self.max_retries + 1,
        )
