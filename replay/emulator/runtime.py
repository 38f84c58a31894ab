"""Runs the pure engine model in real time and tells each request what happened to it.

One asyncio task sleeps until the engine's next event (model seconds x ``time_scale`` = wall
seconds), applies it with ``Engine.advance`` and pushes per-request updates: prefill done
(which makes the first token), a decode-only request joining the batch, every decoded token,
finish. Submissions wake the task so a newcomer joins at the next step boundary, as in
continuous batching. The engine plans one step at a time (``max_segment_steps=1``) so tokens
come out at the step they are made.

If the event loop falls behind (steps shorter than the loop can serve, e.g. a tiny
``time_scale``), steps run back to back and the emulator is slower than the model says, never
faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from replay.emulator.vllm_hashing import PLAIN, BlockNamespace
from replay.engine.engine import DecodeSeq, Engine, PrefillJob, StepReport
from routing.types import KVEvent

log = logging.getLogger(__name__)


class Kind(Enum):
    PREFILLED = "prefilled"  # the prefill finished; carries the first token
    JOINED = "joined"  # the decode batch took the request in (a step boundary)
    TOKENS = "tokens"
    FINISHED = "finished"  # nothing follows
    FAILED = "failed"  # the runtime stopped or crashed; nothing follows


@dataclass(frozen=True, slots=True)
class Update:
    kind: Kind
    tokens: int = 0  # tokens made by this update
    cached_tokens: int = 0  # PREFILLED only


@dataclass(eq=False, slots=True)
class RequestStream:
    """One request's view of the engine: read ``updates`` until FINISHED or FAILED."""

    request_id: str  # the engine's key, unique within the runtime
    prompt_tokens: int
    output_tokens: int  # tokens this engine makes for it (1 for a prefill leg)
    block_hashes: tuple[int, ...] = ()
    token_ids: Sequence[int] | None = None  # for KV events' token_ids; None if unknown
    space: BlockNamespace = PLAIN  # the LoRA adapter / cache salt its blocks are hashed in
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)

    async def next(self) -> Update:
        return await self.updates.get()


class Refused(Exception):
    """The engine refused the request (KV capacity, TBT limit, too many in flight)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# Called after every engine change with the prefix cache's KV events and the streams of the
# prompts that were stored (to look up parents and token ids).
CacheListener = Callable[[list[KVEvent], list[RequestStream]], None]


class EngineRuntime:
    def __init__(
        self,
        engine: Engine,
        time_scale: float,
        block_size: int,
        *,
        max_inflight: int = 4096,
        on_cache_events: CacheListener | None = None,
    ) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self.block_size = block_size
        self.max_inflight = max_inflight
        self.on_cache_events = on_cache_events
        self._streams: dict[str, RequestStream] = {}
        # Aborted mid-step prefills: they still finish that step and (colocated) join the
        # decode batch, so they are dropped again once they surface.
        self._abandoned: set[str] = set()
        self._awaiting_join: set[str] = set()  # decode-only requests not yet told JOINED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._task: asyncio.Task[None] | None = None
        self._waker: asyncio.Future[bool] | None = None
        self._seq = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._task = asyncio.create_task(self._run(), name=f"engine-{self.engine.id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all()

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        """Model seconds since start."""
        assert self._loop is not None, "runtime not started"
        return (self._loop.time() - self._t0) / self.time_scale

    async def sleep_model(self, seconds: float) -> None:
        """Sleep for ``seconds`` of model time (transfers, timeouts measured in model time)."""
        await asyncio.sleep(max(seconds, 0.0) * self.time_scale)

    # ------------------------------------------------------------------ state
    @property
    def inflight(self) -> int:
        return len(self._streams)

    def unique_id(self, request_id: str) -> str:
        """An engine key for ``request_id``; clients may reuse ids while one is in flight."""
        if request_id not in self._streams and request_id not in self._abandoned:
            return request_id
        self._seq += 1
        return f"{request_id}#{self._seq}"

    # ------------------------------------------------------------------ submissions
    def submit_prefill(
        self,
        request_id: str,
        block_hashes: tuple[int, ...],
        prompt_tokens: int,
        output_tokens: int,
        token_ids: Sequence[int] | None = None,
        space: BlockNamespace = PLAIN,
    ) -> RequestStream:
        """Prefill (and, if ``output_tokens`` > 1, decode here: colocated serving)."""
        self._check_room(request_id)
        stream = RequestStream(
            request_id, prompt_tokens, output_tokens, block_hashes, token_ids, space
        )
        self._streams[request_id] = stream
        job = PrefillJob(request_id, block_hashes, prompt_tokens, output_tokens, self.block_size)
        job.adapter = space.lora_name  # its adapter needs a slot (max_adapters)
        self.engine.submit_prefill(job, self.now())
        self._kick()
        return stream

    def submit_decode(
        self, request_id: str, prompt_tokens: int, remaining: int, adapter: str | None = None
    ) -> RequestStream:
        """Join the decode batch with ``remaining`` tokens to make (under LoRA ``adapter``,
        once it has a slot); raises Refused."""
        self._check_room(request_id)
        seq = DecodeSeq(request_id, prompt_tokens, remaining, adapter=adapter)
        reason = self.engine.submit_decode(seq, self.now())
        if reason is not None:
            raise Refused(reason)
        stream = RequestStream(request_id, prompt_tokens, remaining)
        self._streams[request_id] = stream
        self._awaiting_join.add(request_id)
        self._announce_joins()  # an idle engine takes it in at once
        self._kick()
        return stream

    def abort(self, request_id: str) -> None:
        """The client left: forget the request and take it out of the engine."""
        if self._streams.pop(request_id, None) is None:
            return
        self._awaiting_join.discard(request_id)
        if not self.engine.drop(request_id):
            self._abandoned.add(request_id)
        self._kick()

    def publish_cache_events(self, streams: Sequence[RequestStream] = ()) -> None:
        """Hand the prefix cache's pending events to the listener (also after outside inserts)."""
        cache = self.engine.cache
        if cache is None:
            return
        events = cache.drain_events()
        if events and self.on_cache_events is not None:
            self.on_cache_events(events, list(streams))

    def _check_room(self, request_id: str) -> None:
        if self._task is None:
            raise Refused("not_running")  # stopped (or not started): nothing would drive it
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in flight")
        if len(self._streams) >= self.max_inflight:
            raise Refused("too_many_requests")

    def _kick(self) -> None:
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(True)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        try:
            while True:
                t = self.engine.next_event_s()
                if t is None:
                    await self._sleep(None)
                    continue
                delay = (t - self.now()) * self.time_scale
                if delay > 0:
                    if await self._sleep(delay):
                        continue  # woken by a submission: the plan may have changed
                else:
                    await asyncio.sleep(0)  # behind schedule: still let requests in
                self._dispatch(self.engine.advance(t))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("engine runtime crashed; failing all requests")
            self._fail_all()
            raise

    async def _sleep(self, delay: float | None) -> bool:
        """Wait ``delay`` wall seconds (None = forever) or until a submission; True if woken."""
        assert self._loop is not None
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._waker = fut
        handle = None
        if delay is not None:
            handle = self._loop.call_later(delay, _resolve, fut)
        try:
            return await fut
        finally:
            self._waker = None
            if handle is not None:
                handle.cancel()

    def _dispatch(self, report: StepReport) -> None:
        prefilled: list[RequestStream] = []
        for done in report.prefilled:
            rid = done.request_id
            if rid in self._abandoned:
                self._abandoned.discard(rid)
                self.engine.drop(rid)  # a colocated one has just joined the batch
                continue
            stream = self._streams.get(rid)
            if stream is None:
                continue
            prefilled.append(stream)
            stream.updates.put_nowait(Update(Kind.PREFILLED, 1, done.cached_tokens))
            if stream.output_tokens <= 1:
                self._finish(stream)
        self.publish_cache_events(prefilled)
        for seq in report.finished:
            self._report_tokens(seq)
            stream = self._streams.get(seq.request_id)
            if stream is not None:
                self._finish(stream)
        self._announce_joins()
        for seq in self.engine.running.values():
            self._report_tokens(seq)

    def _announce_joins(self) -> None:
        if not self._awaiting_join:
            return
        joined = [rid for rid in self._awaiting_join if rid in self.engine.running]
        for rid in joined:
            self._awaiting_join.discard(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.updates.put_nowait(Update(Kind.JOINED))

    def _report_tokens(self, seq: DecodeSeq) -> None:
        new = seq.generated - seq.reported
        if new <= 0:
            return
        seq.reported = seq.generated
        stream = self._streams.get(seq.request_id)
        if stream is not None:
            stream.updates.put_nowait(Update(Kind.TOKENS, new))

    def _finish(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)
        stream.updates.put_nowait(Update(Kind.FINISHED))

    def _fail_all(self) -> None:
        for stream in self._streams.values():
            stream.updates.put_nowait(Update(Kind.FAILED))
        self._streams.clear()
        self._awaiting_join.clear()


def _resolve(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)
