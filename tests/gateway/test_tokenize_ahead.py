"""A long prompt is tokenized in a worker thread while the event loop goes on."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from config.settings import Settings
from gateway.models import ModelRoute
from gateway.openai import CHAT, COMPLETIONS, RequestHead, parse_head
from gateway.runtime import Gateway
from gateway.tokenize_ahead import TokenizeAhead
from routing.chat_template import ChatTemplate
from routing.hashing import BlockHasher
from routing.prompt_encoder import EnginePromptEncoder
from tests.tiny_model import CHATML, load_tokenizer, write_model_dir

DOCUMENT = "a long document about caches and prefixes, line after line. " * 400  # 24k chars


class ThreadsSeen:
    """A real tokenizer that notes which threads tokenized."""

    def __init__(self) -> None:
        self._tok = load_tokenizer()
        self.threads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        return self._tok.encode(*args, **kwargs)

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.get_ident())
        return self._tok.encode_batch_fast(*args, **kwargs)


def _encoder() -> tuple[EnginePromptEncoder, ThreadsSeen]:
    tok = ThreadsSeen()
    chat = ChatTemplate(CHATML, {"bos_token": "<s>", "eos_token": "</s>"})
    enc = EnginePromptEncoder(tok, chat)
    tok.threads.clear()  # the segment encoder's probes at construction
    return enc, tok


def run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The test's coroutine on a fresh event loop (as the gateway's own tests do)."""

    @functools.wraps(test)
    def sync(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return sync


def _head(body: dict[str, Any], route: ModelRoute | None = None) -> RequestHead:
    return RequestHead(body, False, route, len(json.dumps(body)))


@pytest.fixture
def generous_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait bound 10x the default, for the tests that check that the thread delivers (not
    how fast: on a loaded machine the default bound gives up and the loop tokenizes itself,
    which is the design; bench/loop_stall.py measures the speed)."""
    monkeypatch.setattr("gateway.tokenize_ahead._WAIT_S_PER_CHAR", 10e-6)


@run
async def test_a_long_prompt_is_tokenized_in_another_thread_while_the_loop_runs(
    generous_bound: None,
) -> None:
    enc, tok = _encoder()
    body = {"messages": [{"role": "user", "content": DOCUMENT}]}
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    assert await TokenizeAhead()(CHAT, _head(body), enc, 8192)
    during = ticks - before
    task.cancel()
    assert during > 0  # tokenizing on the loop, no other task could have run
    assert tok.threads and threading.get_ident() not in tok.threads
    seen = len(tok.threads)
    enc.encode(CHAT, body)
    assert len(tok.threads) == seen  # parse finds the work done: nothing tokenized again


@run
async def test_short_prompts_and_a_zero_threshold_stay_on_the_loop() -> None:
    enc, tok = _encoder()
    short = {"messages": [{"role": "user", "content": "hello"}]}
    assert not await TokenizeAhead()(CHAT, _head(short), enc, 8192)
    assert not await TokenizeAhead()(COMPLETIONS, _head({"prompt": DOCUMENT}), enc, 0)
    assert not await TokenizeAhead()(CHAT, _head({"messages": 3}), enc, 1)  # parse answers it
    assert tok.threads == []


@run
async def test_a_served_models_route_uses_that_models_encoder(generous_bound: None) -> None:
    default, default_tok = _encoder()
    model, model_tok = _encoder()
    route = ModelRoute("m", model, BlockHasher(16))
    assert await TokenizeAhead()(COMPLETIONS, _head({"prompt": DOCUMENT}, route), default, 8192)
    assert model_tok.threads and not default_tok.threads


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@run
async def test_the_gateway_parses_a_long_prompt_as_it_would_on_the_loop(
    path: str, tmp_path: Path, generous_bound: None
) -> None:
    model_dir = str(write_model_dir(tmp_path / "model"))
    base = Settings()
    ahead = Gateway(replace(base, routing=replace(base.routing, model_dir=model_dir)))
    key = "messages" if path == CHAT else "prompt"
    value: Any = [{"role": "user", "content": DOCUMENT}] if path == CHAT else DOCUMENT
    raw = json.dumps({key: value, "max_tokens": 4}).encode()
    on_loop = Gateway(
        replace(base, routing=replace(base.routing, model_dir=model_dir, tokenize_offload_chars=0))
    )
    want = on_loop.parse_prompt(path, parse_head(raw), {}, "r1").info
    got = (await ahead.parse(path, raw, {}, "r1")).info
    assert got.block_hashes == want.block_hashes and got.prompt_tokens == want.prompt_tokens
    assert got.prompt_tokens > 1000
    sample = ahead.metrics.registry.get_sample_value
    assert sample("kvgate_prompts_tokenized_ahead_total", {"outcome": "delivered"}) == 1
    assert on_loop.tokenizing.delivered == 0


class SlowInThreads(ThreadsSeen):
    """A tokenizer that a worker thread waits long for (a loop that starves it of the GIL)."""

    def __init__(self, main: int) -> None:
        super().__init__()
        self.main = main

    def encode_batch_fast(self, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self.main:
            time.sleep(0.3)
        return super().encode_batch_fast(*args, **kwargs)


@run
async def test_a_thread_that_gets_no_turn_is_not_waited_for_past_its_bound() -> None:
    tok = SlowInThreads(threading.get_ident())
    chat = ChatTemplate(CHATML, {"bos_token": "<s>", "eos_token": "</s>"})
    enc = EnginePromptEncoder(tok, chat)
    body = {"prompt": DOCUMENT}
    t0 = time.perf_counter()
    ahead = TokenizeAhead()
    assert not await ahead(COMPLETIONS, _head(body), enc, 8192)
    assert ahead.gave_up == 1
    assert time.perf_counter() - t0 < 0.25  # gave up at its bound (~24 ms), not at 0.3 s
    want = EnginePromptEncoder(load_tokenizer(), chat).encode(COMPLETIONS, body).packed
    assert enc.encode(COMPLETIONS, body).packed == want  # the loop tokenized it itself
    await asyncio.sleep(0.4)  # the late result lands nowhere
    assert not enc._ready


def test_a_loop_with_no_idle_moment_still_lets_the_thread_deliver(generous_bound: None) -> None:
    asyncio.run(_busy_loop_case())


async def _busy_loop_case() -> None:
    enc, tok = _encoder()
    ahead = TokenizeAhead()
    stop = False

    async def busy() -> None:  # ready work at every turn: the loop never blocks
        while not stop:
            sum(range(2000))
            await asyncio.sleep(0)

    task = asyncio.create_task(busy())
    try:
        body = {"prompt": DOCUMENT}
        assert await ahead(COMPLETIONS, _head(body), enc, 8192)  # within its bound
        assert threading.get_ident() not in tok.threads
    finally:
        stop = True
        await task
    await asyncio.sleep(0.01)
    assert ahead._yielder is None  # no job out: the loop is not held any more


@run
async def test_a_prompt_the_thread_cannot_tokenize_is_answered_by_the_usual_parse(
    tmp_path: Path,
) -> None:
    from gateway.openai import BadRequest

    model_dir = str(write_model_dir(tmp_path / "model"))
    base = Settings()
    gw = Gateway(replace(base, routing=replace(base.routing, model_dir=model_dir)))
    raw = b'{"prompt": "' + b"x " * 6000 + b'\\ud800", "max_tokens": 4}'  # a lone surrogate
    with pytest.raises(BadRequest) as exc:
        await gw.parse(COMPLETIONS, raw, {}, "r1")
    assert exc.value.param == "prompt" and "surrogate" in exc.value.message
    assert gw.tokenizing.delivered == 0


@run
async def test_one_job_per_thread_out_at_a_time_and_the_rest_on_the_loop() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    outcomes = Counter("ahead", "outcomes", ["outcome"], registry=registry)
    tok = SlowInThreads(threading.get_ident())  # each job holds its thread 0.3 s
    enc = EnginePromptEncoder(tok, ChatTemplate(CHATML, {"bos_token": "<s>"}))
    ahead = TokenizeAhead(outcomes, threads=1)
    first = asyncio.create_task(ahead(COMPLETIONS, _head({"prompt": DOCUMENT}), enc, 8192))
    await asyncio.sleep(0.05)  # it gave up waiting (~24 ms), but its job still holds the thread
    assert not await ahead(COMPLETIONS, _head({"prompt": "2 " + DOCUMENT}), enc, 8192)
    assert not await first
    sample = registry.get_sample_value
    assert sample("ahead_total", {"outcome": "threads_busy"}) == 1
    assert sample("ahead_total", {"outcome": "gave_up"}) == 1
    ahead.close()
