"""A long prompt is tokenized in a worker thread, so that the event loop goes on meanwhile.

The engine-exact encoder (``routing.model_dir``) runs the model's Rust tokenizer, about
0.14 us per character on this project's machine: ~0.3 ms for a 2k-token chat turn, ~5 ms for
a 32k-character document, during which every other request and stream of the gateway would
wait. The tokenizer releases the GIL, so the same work in a thread costs the loop only the
hand-off and runs on another core where there is one (vLLM's own front end tokenizes off its
loop for the same reason). Short prompts stay on the loop (the hand-off would cost more than
it saves), as do prompts whose stretches the segment cache already holds (a shared system
prompt). The results go back to the encoder on the loop's thread, so its caches are only ever
touched there; ``parse_prompt`` then finds them.

A busy loop starves the thread: it releases the GIL at every non-blocking poll and takes it
back at once, and each release wakes the waiting thread, which so never times out and never
asks for the GIL (CPython's switch request). Measured (bench/loop_stall.py, a loop with no
idle moment): a 6 ms job took a median 107 ms, at worst 4.2 s. So while jobs are out, one
task per gateway blocks the loop for ``_YIELD_S`` every ``_YIELD_EVERY_S`` (5 % of it), long
enough for a waiting thread to take the GIL; and the wait is bounded
(``_WAIT_S_PER_CHAR``, ~7x this machine's tokenizing time): past it the loop tokenizes the
prompt itself, as it would have without the thread. Jobs run in the gateway's own threads,
at most one per core at a time (a burst of long prompts beyond that is tokenized on the loop,
as before, rather than queue past its bound and be done twice); never in asyncio's default
executor, which also resolves host names.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Counter

from gateway.openai import RequestHead
from routing.prompt_encoder import PromptEncoder

log = logging.getLogger("kvgate.gateway")
_WAIT_S_PER_CHAR = 1e-6
_MIN_WAIT_S = 0.005
_YIELD_S = 50e-6
_YIELD_EVERY_S = 0.001


class TokenizeAhead:
    """Long prompts' tokenizing in worker threads, for one gateway's event loop."""

    def __init__(self, outcomes: Counter | None = None, threads: int | None = None) -> None:
        self._threads = threads or os.cpu_count() or 1
        self._pool: ThreadPoolExecutor | None = None  # made on first use
        self._out = 0  # jobs in worker threads
        self.delivered = 0  # prompts tokenized in a thread
        self.gave_up = 0  # ... whose thread did not deliver within the bound
        self._outcomes = outcomes  # kvgate_prompts_tokenized_ahead_total{outcome}
        self._yielder: asyncio.Task[None] | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _count(self, outcome: str) -> None:
        if self._outcomes is not None:
            self._outcomes.labels(outcome).inc()

    async def __call__(
        self, path: str, head: RequestHead, encoder: PromptEncoder, min_chars: int
    ) -> bool:
        """Tokenizes the request's prompt in a worker thread when at least ``min_chars``
        characters of it need tokenizing (0: never); True if it did. Any failure is left to
        ``parse_prompt``, which meets it again and answers it as always."""
        if min_chars <= 0 or head.size < min_chars:  # cheap: most requests end here
            return False
        if head.route is not None:  # config ``models``: the model's own encoder
            encoder = head.route.encoder
        if self._out >= self._threads:
            self._count("threads_busy")
            return False
        work = encoder.prepare(path, head.body, min_chars)
        if work is None:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="kvgate-tokenize")
        job = asyncio.get_running_loop().run_in_executor(self._pool, work.run)
        job.add_done_callback(self._job_done)
        self._out += 1
        if self._yielder is None:
            self._yielder = asyncio.create_task(self._yield_gil())
        wait = max(_MIN_WAIT_S, work.chars * _WAIT_S_PER_CHAR)
        try:
            results = await asyncio.wait_for(asyncio.shield(job), wait)
        except TimeoutError:
            self.gave_up += 1
            self._count("gave_up")
            log.debug("tokenizing ahead: no result in %.3f s; the loop tokenizes", wait)
            return False
        except Exception as exc:  # bad text, say: the loop's own encode meets and answers it
            log.debug("tokenizing ahead failed (%r); the loop tokenizes", exc)
            return False
        encoder.accept(work, results)
        self.delivered += 1
        self._count("delivered")
        return True

    def _job_done(self, job: asyncio.Future[list[bytes]]) -> None:
        self._out -= 1
        if not job.cancelled():
            job.exception()  # retrieved: a job given up on may fail later, unheard

    async def _yield_gil(self) -> None:
        try:
            while self._out > 0:
                # Blocking on purpose: a sleep releases the GIL for long enough that a
                # worker thread, woken by the release, takes it (see the module docstring).
                time.sleep(_YIELD_S)
                await asyncio.sleep(_YIELD_EVERY_S)
        finally:
            self._yielder = None
