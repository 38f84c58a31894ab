"""Warm-up replication sink: copy a hot prefix by prefilling it on the destination engine.

For engines without a KV-copy API (vLLM without a shared KV store, llama.cpp): the destination
computes the prefix itself from a ``max_tokens: 1`` completion whose prompt is the prefix's
token ids (``POST /v1/completions {"prompt": [ids...]}``; vLLM and llama.cpp both take
token-id prompts and cache them like any prompt). The token ids come from the gateway's
``PrefixTokenStore`` (backends/prefix_tokens.py), found by the command's ``prefix_key``.

When: only while the predictors say the destination has room (``has_spare_capacity``: a pure
check on the scheduler's books), waiting for it up to the command's timeout, since a warm-up
is extra prefill work that must not delay the requests already there.
Confirmed by the engine's own cache signal: where the destination publishes KV events, the KV
index holding every block of the command as *confirmed* (an engine event, not a prediction;
only the blocks inside whole blocks of the engine's own size, which is all it caches);
otherwise (llama.cpp) the warm-up's answer showing the whole prefix processed
(``usage.prompt_tokens``).

Through a connector's store (``publish_on_source``; ``replication_sink = "connector_store"``):
where the engines' own KV connector shares a store that matches prompts by their tokens (vLLM's
ExampleConnector directory; LMCacheConnectorV1 with a shared backend), the same warm-up first
goes to the source, which holds the prefix (a cache hit there) and whose connector writes it
to the store; the destination's warm-up then loads it from the store instead of computing it.
A source that cannot be reached, or is too busy to answer within half the copy's time, only
costs that saving: the destination computes the prefix.

A reactive command (a request waiting for its own prefix) is not executed: the request's own
prefill on the destination computes and caches the same tokens, so a warm-up first could only
delay it. Contract: backends/replication.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from backends.prefix_tokens import PrefixTokens
from backends.replication import Outcome, ReplicationResult
from routing.conductor import Conductor
from routing.instance_books import InstanceState
from routing.types import ReplicationCommand

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # worth another try; other 4xx: no
log = logging.getLogger("kvgate.replication")


def has_spare_capacity(inst: InstanceState, now: float, tokens: int, max_queue_s: float) -> bool:
    """Whether the scheduler's books say ``inst`` can take a ``tokens``-token warm-up prefill
    now without hurting its own requests: eligible, predicted prefill queue below
    ``max_queue_s``, a free batch slot and KV room for the prefix. Pure: no clock, no I/O."""
    return (
        inst.eligible
        and inst.does_prefill
        and inst.queue_time(now) < max_queue_s
        and inst.batch < inst.max_batch
        and inst.kv_fits(tokens)
    )


class PrefixLookup(Protocol):
    def lookup(self, block_hash: int) -> PrefixTokens | None: ...


class WarmupCluster(Protocol):
    """What the sink reads about the destination, live."""

    def url(self, instance_id: str) -> str | None: ...

    def spare(self, instance_id: str, tokens: int) -> bool: ...

    def reports_kv_events(self, instance_id: str) -> bool: ...

    def confirmed(self, instance_id: str, block_hashes: Sequence[int]) -> bool: ...

    def engine_block_tokens(self, instance_id: str) -> int | None: ...


class ConductorCluster:
    """``WarmupCluster`` over a running gateway: its Conductor (books and KV index), clock and
    live instance tables (instance id -> base URL, -> whether its KV events reach the index,
    -> the engine's own KV block size as its metrics state it, None if unknown)."""

    def __init__(
        self,
        conductor: Conductor,
        clock: Callable[[], float],
        urls: Callable[[str], str | None],
        kv_events: Callable[[str], bool],
        *,
        max_queue_s: float,
        engine_block_tokens: Callable[[str], int | None] = lambda iid: None,
    ) -> None:
        self._conductor = conductor
        self._clock = clock
        self._urls = urls
        self._kv_events = kv_events
        self._engine_block = engine_block_tokens
        self.max_queue_s = max_queue_s

    def url(self, instance_id: str) -> str | None:
        return self._urls(instance_id)

    def spare(self, instance_id: str, tokens: int) -> bool:
        inst = self._conductor.instances.get(instance_id)
        return inst is not None and has_spare_capacity(
            inst, self._clock(), tokens, self.max_queue_s
        )

    def reports_kv_events(self, instance_id: str) -> bool:
        return self._kv_events(instance_id)

    def confirmed(self, instance_id: str, block_hashes: Sequence[int]) -> bool:
        index = self._conductor.index
        return all(
            index.holds(instance_id, h) and not index.is_predicted(instance_id, h)
            for h in block_hashes
        )

    def engine_block_tokens(self, instance_id: str) -> int | None:
        return self._engine_block(instance_id)


@dataclass(frozen=True, slots=True)
class _Failure:
    error: str
    retry: bool


class WarmupSink:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        cluster: WarmupCluster,
        prefixes: PrefixLookup,
        *,
        kv_bytes_per_token: Mapping[str, int],
        timeout_s: float = 30.0,
        max_retries: int = 2,
        poll_s: float = 0.05,
        pin: Callable[[str, str, Sequence[int]], int | None] | None = None,
        unpin: Callable[[str], None] | None = None,
        publish_on_source: bool = False,
    ) -> None:
        self._session = session
        self._cluster = cluster
        self._prefixes = prefixes
        self._kv_bytes = kv_bytes_per_token
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.poll_s = poll_s  # spare-capacity and confirmation polling, and retry back-off
        # llama.cpp: the slot the warm-up fills (the one later requests for the prefix wait for)
        self._pin = pin
        self._unpin = unpin
        self.publish_on_source = publish_on_source  # the source writes it to the shared store

    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        start = time.perf_counter()

        def result(
            outcome: Outcome, error: str | None = None, attempts: int = 0, nbytes: int = 0
        ) -> ReplicationResult:
            elapsed = time.perf_counter() - start
            return ReplicationResult(cmd.command_id, outcome, elapsed, nbytes, error, attempts)

        if cmd.request_id is not None:
            return result(Outcome.NOT_EXECUTED, "reactive: the request's own prefill caches it")
        url = self._cluster.url(cmd.destination)
        if url is None:
            return result(Outcome.NOT_EXECUTED, "unknown destination instance")
        prefix = self._prefixes.lookup(cmd.prefix_key)
        if prefix is None:
            return result(Outcome.NOT_EXECUTED, "prefix token ids not known to the gateway")
        deadline = start + self.timeout_s
        if not await self._wait_until(
            lambda: self._cluster.spare(cmd.destination, prefix.n_tokens), deadline
        ):
            return result(Outcome.NOT_EXECUTED, "destination busy: no spare capacity in time")
        attempts = 0
        waiting_for = "the warm-up answer"
        try:
            async with asyncio.timeout(max(deadline - time.perf_counter(), 0.0)):
                if self.publish_on_source:
                    await self._publish(cmd, prefix, (deadline - time.perf_counter()) / 2)
                failure: _Failure | None = None
                for attempts in range(1, self.max_retries + 2):
                    failure = await self._prefill(url, cmd, prefix)
                    if failure is None or not failure.retry or attempts > self.max_retries:
                        break
                    await asyncio.sleep(self.poll_s * 2**attempts)
                if failure is not None:
                    return result(Outcome.FAILED, failure.error, attempts)
                if self._cluster.reports_kv_events(cmd.destination):
                    waiting_for = "the engine's KV events for every block"
                    block = self._cluster.engine_block_tokens(cmd.destination)
                    target = storable_blocks(cmd, prefix.n_tokens, block)
                    while not self._cluster.confirmed(cmd.destination, target):
                        await asyncio.sleep(self.poll_s)
        except TimeoutError:
            return result(Outcome.TIMEOUT, f"timeout waiting for {waiting_for}", attempts)
        # Bytes of the blocks copied (the rest of the prefix the destination already held).
        nbytes = cmd.tokens * self._kv_bytes.get(cmd.destination, 0)
        return result(Outcome.OK, attempts=attempts, nbytes=nbytes)

    async def _wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        while not ready():
            left = deadline - time.perf_counter()
            if left <= 0:
                return False
            await asyncio.sleep(min(self.poll_s, left))
        return True

    async def _publish(
        self, cmd: ReplicationCommand, prefix: PrefixTokens, budget_s: float
    ) -> None:
        """The source, which holds the prefix, runs the warm-up first: its connector writes
        the prefix to the shared store for the destination to load. The source is the busy
        holder the copy relieves, so this gets at most ``budget_s`` (half of what the copy has
        left) before the destination goes on without it."""
        url = self._cluster.url(cmd.source)
        failure: _Failure | None = _Failure(f"source {cmd.source!r} has no engine URL", False)
        if url is not None:
            try:
                async with asyncio.timeout(max(budget_s, 0.0)):
                    failure = await self._prefill(url, cmd, prefix, publish=True)
            except TimeoutError:
                failure = _Failure(f"no answer from the source within {budget_s:.1f} s", False)
        if failure is not None:
            log.warning(
                "replication %s: the source did not write the prefix to the store (%s); the "
                "destination computes it",
                cmd.command_id,
                failure.error,
            )

    async def _prefill(
        self, url: str, cmd: ReplicationCommand, prefix: PrefixTokens, publish: bool = False
    ) -> _Failure | None:
        """One warm-up request (on the source when ``publish``); None when the engine answered
        that it processed the prefix."""
        rid = f"kvgate-{'publish' if publish else 'warmup'}-{cmd.command_id}"
        body = warmup_body(prefix)
        pin = self._pin if not publish else None
        slot = pin(rid, cmd.destination, prefix.block_hashes) if pin else None
        if slot is not None:
            body["id_slot"] = slot
        try:
            async with self._session.post(
                url + "/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as resp:
                payload = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, ValueError) as exc:
            return _Failure(f"{type(exc).__name__}: {exc}", retry=True)
        finally:
            if self._unpin is not None and pin is not None:
                self._unpin(rid)
        if status != 200:
            return _Failure(f"HTTP {status}: {str(payload)[:300]}", retry=status in _RETRY_STATUS)
        processed = prompt_tokens_processed(payload)
        if processed is None or processed < prefix.n_tokens:
            return _Failure(
                f"engine processed {processed} of the prefix's {prefix.n_tokens} tokens",
                retry=False,
            )
        return None


def storable_blocks(
    cmd: ReplicationCommand, prefix_tokens: int, engine_block_tokens: int | None
) -> tuple[int, ...]:
    """The command's blocks the engine can report stored: it caches whole blocks of its own
    size, so when that is larger than kvgate's a prefix ending inside one leaves kvgate's last
    block(s) uncached (e.g. engine 32 / kvgate 16 and an odd number of kvgate blocks)."""
    blocks = cmd.block_hashes
    if not engine_block_tokens or not blocks:
        return blocks
    own = cmd.tokens // len(blocks)  # kvgate's block size
    whole = prefix_tokens // engine_block_tokens * engine_block_tokens // own
    first = prefix_tokens // own - len(blocks)  # the command copies the prefix's last blocks
    return blocks[: max(whole - first, 0)]


def warmup_body(prefix: PrefixTokens) -> dict[str, Any]:
    """The warm-up request: prefill the prefix, generate one token, cache like any prompt."""
    body: dict[str, Any] = {
        "prompt": prefix.token_ids(),
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": False,
    }
    if prefix.model is not None:
        body["model"] = prefix.model
    if prefix.cache_salt is not None:
        body["cache_salt"] = prefix.cache_salt
    return body


def prompt_tokens_processed(payload: Any) -> int | None:
    """Prompt tokens an OpenAI-style answer says the engine took in (computed or from its
    cache): ``usage.prompt_tokens``, else llama.cpp's ``timings`` (prompt_n + cache_n)."""
    if not isinstance(payload, Mapping):
        return None
    usage = payload.get("usage")
    if isinstance(usage, Mapping) and isinstance(usage.get("prompt_tokens"), int):
        return int(usage["prompt_tokens"])
    timings = payload.get("timings")
    if isinstance(timings, Mapping):
        n, cached = timings.get("prompt_n"), timings.get("cache_n")
        if isinstance(n, int) and isinstance(cached, int):
            return n + cached
    return None
