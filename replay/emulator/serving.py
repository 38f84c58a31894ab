"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses``: one request from
arrival to last token (the Responses API's shapes: replay/emulator/responses_shapes.py).

Which leg a request is comes from the request itself:
- vLLM protocol, ``kv_transfer_params.do_remote_decode`` -> prefill leg: prefill, one token,
  pin the KV, answer with the ``kv_transfer_params`` the decode needs;
- vLLM protocol, ``kv_transfer_params.do_remote_prefill`` -> decode leg: pull the KV from the
  prefill named in them, then decode;
- SGLang protocol with ``bootstrap_room`` -> prefill leg on a prefill instance (registers the
  room), decode leg on a decode instance (waits for the room, then the transfer);
- anything else -> colocated serving (prefill then decode here), on any role, as vLLM does.

A decode leg produces ``max_tokens`` tokens like the real engines, the first only once the
decode batch has taken the request in: vLLM recomputes the last prompt token in its first
decode step and samples the first token there (the prefill's is dropped), so all
``max_tokens`` come from decode steps; SGLang's decode sends the prefill's token (carried with
the KV) at the step boundary where it takes the request in, the other ``max_tokens - 1`` from
decode steps. Errors found before the response starts get a status code (400, 502, 503, 504);
the SSE headers are sent only once the request is admitted.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from enum import Enum
from typing import Any

from aiohttp import web

from config.settings import PDProtocol, Role
from replay.emulator.openai_api import (
    ParsedRequest,
    RequestError,
    ResponseShaper,
    error_body,
    parse_request,
    parse_responses_request,
    usage,
)
from replay.emulator.pd import PinnedKV, pull_kv, wait_room
from replay.emulator.responses_shapes import ResponsesShaper, responses_usage
from replay.emulator.runtime import Kind, Refused, RequestStream
from replay.emulator.state import EmulatorState
from replay.emulator.vllm_hashing import PLAIN, BlockNamespace

STATE_KEY: web.AppKey[EmulatorState] = web.AppKey("emulator_state", EmulatorState)


class Leg(Enum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


def choose_leg(state: EmulatorState, req: ParsedRequest) -> Leg:
    cfg = state.config
    if cfg.protocol is PDProtocol.VLLM and req.kv_transfer_params:
        if req.kv_transfer_params.get("do_remote_decode"):
            return Leg.PREFILL
        if req.kv_transfer_params.get("do_remote_prefill"):
            return Leg.DECODE
    if cfg.protocol is PDProtocol.SGLANG and req.bootstrap is not None:
        if cfg.role is Role.PREFILL:
            return Leg.PREFILL
        if cfg.role is Role.DECODE:
            return Leg.DECODE
    return Leg.COLOCATED


def error_response(exc: RequestError, headers: dict[str, str]) -> web.Response:
    return web.json_response(
        error_body(exc.status, exc.message, exc.param), status=exc.status, headers=headers
    )


class RequestRun:
    """One request inside this instance: admission, then its tokens as they are made."""

    def __init__(self, state: EmulatorState, req: ParsedRequest, ext_id: str, leg: Leg) -> None:
        self.state, self.req, self.ext_id, self.leg = state, req, ext_id, leg
        self.iid = state.runtime.unique_id(ext_id)
        self.prompt_tokens = len(req.token_ids)
        self.target = 1 if leg is Leg.PREFILL else req.max_tokens  # tokens the client gets
        self.cached_tokens = 0
        self.generated = 0
        self.stream: RequestStream | None = None
        self.carried_first = False  # SGLang decode leg: the prefill's token, sent at the join
        self.adapter: str | None = None  # the LoRA adapter it runs under
        self.kv_params: dict[str, Any] | None = None  # vLLM prefill leg's answer
        self.finished = False
        self.arrival = asyncio.get_running_loop().time()
        self._last: float | None = None

    async def admit(self) -> None:
        st, req = self.state, self.req
        space = request_space(st, req)
        if self.prompt_tokens + self.target > st.max_model_len:
            raise RequestError(
                400,
                f"prompt ({self.prompt_tokens} tokens) + max_tokens ({self.target}) exceeds "
                f"the maximum model length {st.max_model_len}",
                "max_tokens",
            )
        self.adapter = space.lora_name
        if self.leg is not Leg.DECODE:
            # kvgate's own keys, in the request's space as a gateway keys it (plain: the
            # ordinary root), so that both agree on what an adapter's or a salted prompt is.
            root = st.hasher.namespace_root(space.lora_name, space.cache_salt)
            hashes = st.hasher.hash_tokens(req.token_ids, root)
            self.stream = self._submit(
                lambda: st.runtime.submit_prefill(
                    self.iid, hashes, self.prompt_tokens, self.target, req.token_ids, space
                )
            )
            return
        assert st.session is not None
        if req.bootstrap is not None and st.config.protocol is PDProtocol.SGLANG:
            entry, source = await wait_room(
                st.session, req.bootstrap, st.config.bootstrap_timeout_s
            )
            await st.transfers.transfer(source, st.config.engine_id, self.prompt_tokens)
        else:
            assert req.kv_transfer_params is not None
            entry = await pull_kv(st.session, req.kv_transfer_params, st.config.engine_id)
        # Report the prefill's prefix-cache hit: the client's only view of reuse in SGLang.
        self.cached_tokens = entry.cached_tokens
        self.carried_first = st.config.protocol is PDProtocol.SGLANG
        decode = self.target - 1 if self.carried_first else self.target
        if decode > 0:
            self.stream = self._submit(
                lambda: st.runtime.submit_decode(
                    self.iid, self.prompt_tokens, decode, space.lora_name
                )
            )

    def _submit(self, submit: Callable[[], RequestStream]) -> RequestStream:
        try:
            stream: RequestStream = submit()
        except Refused as exc:  # never admitted: not an engine request, so no metrics
            raise RequestError(503, _refusal_message(self.state, exc.reason)) from None
        return stream

    async def tokens(self) -> AsyncIterator[int]:
        """Token counts as they are made; ends when the request is done."""
        if self.carried_first and self.stream is None:
            self._count(1)
            yield 1
        while self.stream is not None:
            update = await self.stream.next()
            if update.kind is Kind.PREFILLED:
                self._prefilled(update.cached_tokens)
            if update.kind is Kind.JOINED and self.carried_first:
                self._count(1)
                yield 1
            if update.tokens:
                self._count(update.tokens)
                yield update.tokens
            if update.kind is Kind.FAILED:
                raise RequestError(503, "the engine emulator is shutting down")
            if update.kind is Kind.FINISHED:
                break
        self.finished = True
        self.state.metrics.finished("length")

    def _prefilled(self, cached: int) -> None:
        st = self.state
        self.cached_tokens = cached
        st.metrics.prefilled(self.prompt_tokens, cached)
        if self.leg is not Leg.PREFILL:
            return
        entry = PinnedKV(self.ext_id, self.prompt_tokens, cached)
        if st.config.protocol is PDProtocol.SGLANG and self.req.bootstrap is not None:
            st.rooms.register(self.req.bootstrap.room, entry)
            return
        entry.block_ids = st.block_ids(self.prompt_tokens)
        st.pinned.pin(entry)
        self.kv_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": entry.block_ids,
            "remote_engine_id": st.config.engine_id,
            "remote_request_id": self.ext_id,
            "remote_host": st.config.advertised_host,
            "remote_port": st.port,
            "tp_size": 1,
        }

    def _count(self, n: int) -> None:
        now = asyncio.get_running_loop().time()
        if self._last is None:
            self.state.metrics.first_token(now - self.arrival)
            if self.adapter is not None:  # vLLM's LoRA stats see a request at its first output
                self.state.adapter_entered(self.iid, self.adapter)
            self.state.metrics.tokens(n, None)
        else:
            self.state.metrics.tokens(n, now - self._last)
        self._last = now
        self.generated += n

    def close(self) -> None:
        """Always called: an unfinished request was abandoned by its client."""
        self.state.adapter_left(self.iid)
        if self.finished:
            return
        self.finished = True
        if self.stream is not None or self.carried_first:  # it reached the engine
            self.state.runtime.abort(self.iid)
            self.state.metrics.finished("abort")

    def usage(self) -> dict[str, Any]:
        shape = responses_usage if self.req.responses else usage
        return shape(self.prompt_tokens, self.generated, self.cached_tokens)


def request_space(state: EmulatorState, req: ParsedRequest) -> BlockNamespace:
    """The namespace of the request's blocks: the LoRA adapter its ``model`` names, and its
    cache salt. A model the instance does not serve is vLLM's 404 (no model: the base one)."""
    adapter = state.adapters.get(req.model) if req.model else None
    if adapter is None and req.model and req.model not in state.config.served_names:
        raise RequestError(404, f"The model `{req.model}` does not exist.", "model")
    if adapter is None and req.cache_salt is None:
        return PLAIN
    return replace(adapter or PLAIN, cache_salt=req.cache_salt)


def _refusal_message(state: EmulatorState, reason: str) -> str:
    if reason == "tbt_slo":
        limit = state.config.decode_tbt_limit_ms
        return f"decode instance refused the request: its step time would exceed {limit} ms"
    if reason == "kv_capacity":
        return "decode instance refused the request: not enough KV cache capacity"
    return f"the engine refused the request: {reason}"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


Shaper = ResponseShaper | ResponsesShaper


async def _whole(run: RequestRun, shaper: Shaper, headers: dict[str, str]) -> web.Response:
    async for _ in run.tokens():
        pass
    if isinstance(shaper, ResponsesShaper):
        run.state.responses.add(shaper.id)
        return web.json_response(shaper.response(run.generated, run.usage(), True), headers=headers)
    body = shaper.full(run.generated, "length", run.usage())
    if run.state.config.protocol is PDProtocol.VLLM:
        body["kv_transfer_params"] = run.kv_params
    return web.json_response(body, headers=headers)


async def _stream(
    request: web.Request, run: RequestRun, shaper: Shaper, headers: dict[str, str]
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    try:
        return await _write_tokens(resp, run, shaper)
    except ConnectionResetError:
        return resp  # the client left; serve()'s cleanup aborts the request


async def _write_tokens(
    resp: web.StreamResponse, run: RequestRun, shaper: Shaper
) -> web.StreamResponse:
    if isinstance(shaper, ResponsesShaper):
        return await _write_events(resp, run, shaper)
    index = 0
    try:
        async for n in run.tokens():
            for _ in range(n):
                finish = "length" if index == run.target - 1 else None
                await resp.write(sse(shaper.chunk(index, finish)))
                index += 1
        if run.req.include_usage:
            await resp.write(sse(shaper.usage_chunk(run.usage())))
    except RequestError as exc:  # too late for a status code: an error event, as vLLM does
        await resp.write(sse(error_body(exc.status, exc.message)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _write_events(
    resp: web.StreamResponse, run: RequestRun, shaper: ResponsesShaper
) -> web.StreamResponse:
    """A Responses stream: its opening events at once, a delta event per token, the close."""
    await resp.write(shaper.opening())
    index = 0
    try:
        async for n in run.tokens():
            for _ in range(n):
                await resp.write(shaper.token(index))
                index += 1
        await resp.write(shaper.closing(run.generated, run.usage()))
        run.state.responses.add(shaper.id)
    except RequestError as exc:  # vLLM's error event of a Responses stream
        await resp.write(shaper.event("error", code=str(exc.status), message=exc.message))
    await resp.write_eof()
    return resp


def _parse(state: EmulatorState, body: Any, chat: bool, is_responses: bool) -> ParsedRequest:
    limit = state.config.default_max_tokens
    if not is_responses:
        return parse_request(
            body, chat=chat, encoder=state.prompt_encoder, default_max_tokens=limit
        )
    req = parse_responses_request(body, encoder=state.prompt_encoder, default_max_tokens=limit)
    previous = req.previous_response
    if previous is not None and previous not in state.responses:  # vLLM's answer
        raise RequestError(404, f"Response with id '{previous}' not found.", "response_id")
    return req


def request_ids(request: web.Request) -> tuple[str, dict[str, str]]:
    """The request's id (the client's X-Request-Id, else a new one) and the answer's headers."""
    ext_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return ext_id, {"X-Request-Id": ext_id}


async def json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not valid JSON") from None


async def serve(request: web.Request, chat: bool, is_responses: bool = False) -> web.StreamResponse:
    ext_id, headers = request_ids(request)
    try:
        body = await json_body(request)
    except RequestError as exc:
        return error_response(exc, headers)
    return await serve_body(request, body, ext_id, headers, chat, is_responses)


async def serve_body(
    request: web.Request,
    body: Any,
    ext_id: str,
    headers: dict[str, str],
    chat: bool,
    is_responses: bool = False,
) -> web.StreamResponse:
    """One request whose body is read already (a single prompt, one engine request)."""
    state = request.app[STATE_KEY]
    try:
        req = _parse(state, body, chat, is_responses)
    except RequestError as exc:
        return error_response(exc, headers)
    run = RequestRun(state, req, ext_id, choose_leg(state, req))
    model = req.model or state.config.served_model
    shaper: Shaper = ResponseShaper(chat, ext_id, model)
    if is_responses:
        shaper = ResponsesShaper(ext_id, model, req.previous_response, req.max_tokens)
    try:
        await run.admit()
        if req.stream:
            return await _stream(request, run, shaper, headers)
        return await _whole(run, shaper, headers)
    except RequestError as exc:  # only before the response started (_stream handles after)
        return error_response(exc, headers)
    finally:
        run.close()  # unfinished here = the client left: take it out of the engine


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=True)


async def responses(request: web.Request) -> web.StreamResponse:
    return await serve(request, chat=True, is_responses=True)
