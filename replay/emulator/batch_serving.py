"""A completion whose ``prompt`` is a batch (a list of texts, or of token-id lists), served as
vLLM serves it: each prompt its own request in the engine (its own prefix-cache lookup, its own
place in the batch), one answer. Whole: one ``text_completion`` whose choices are numbered by
prompt (``n`` is 1 here) and whose usage is the prompts' summed. Streamed: the prompts' chunks
as they are made, each naming its prompt's index, then one usage chunk (``include_usage``) and
one ``[DONE]``. A batch mixing texts and token lists is a 400, as in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from replay.emulator.openai_api import (
    ParsedRequest,
    RequestError,
    ResponseShaper,
    error_body,
    parse_request,
    usage,
)
from replay.emulator.serving import (
    STATE_KEY,
    Leg,
    RequestRun,
    error_response,
    json_body,
    request_ids,
    serve_body,
    sse,
)
from replay.emulator.state import EmulatorState


async def completions(request: web.Request) -> web.StreamResponse:
    """``/v1/completions``: a batch of prompts here, a single prompt by ``serving``; the body
    is read and parsed once."""
    ext_id, headers = request_ids(request)
    state = request.app[STATE_KEY]
    try:
        body = await json_body(request)
        prompts = batch_of_prompts(body)
        reqs = parse_batch(state, body, prompts) if prompts is not None else None
    except RequestError as exc:
        return error_response(exc, headers)
    if reqs is None:
        return await serve_body(request, body, ext_id, headers, chat=False)
    return await serve_batch(request, state, reqs, ext_id, headers)


def batch_of_prompts(body: Any) -> list[Any] | None:
    """The prompts of a batch (two or more), or None for a single prompt."""
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    if any(isinstance(p, str | list) for p in prompt):
        raise RequestError(
            400, "a batch is a list of strings or a list of token-id lists", "prompt"
        )
    return None  # a list of token ids: one prompt


def parse_batch(
    state: EmulatorState, body: dict[str, Any], prompts: list[Any]
) -> list[ParsedRequest]:
    reqs = [
        parse_request(
            {**body, "prompt": p},
            chat=False,
            encoder=state.prompt_encoder,
            default_max_tokens=state.config.default_max_tokens,
        )
        for p in prompts
    ]
    if any(r.kv_transfer_params or r.bootstrap for r in reqs):
        raise RequestError(400, "a batch of prompts is served colocated, not as a P/D leg")
    return reqs


async def serve_batch(
    request: web.Request,
    state: EmulatorState,
    reqs: list[ParsedRequest],
    ext_id: str,
    headers: dict[str, str],
) -> web.StreamResponse:
    runs = [RequestRun(state, req, f"{ext_id}-{i}", Leg.COLOCATED) for i, req in enumerate(reqs)]
    shaper = ResponseShaper(False, ext_id, reqs[0].model or state.config.served_model)
    try:
        for run in runs:
            await run.admit()
        if reqs[0].stream:
            return await _stream(request, runs, shaper, headers)
        return await _whole(runs, shaper, headers)
    except RequestError as exc:  # only before the response started
        return error_response(exc, headers)
    finally:
        for run in runs:
            run.close()  # unfinished here = the client left: take it out of the engine


def _summed(runs: list[RequestRun]) -> dict[str, Any]:
    return usage(
        sum(r.prompt_tokens for r in runs),
        sum(r.generated for r in runs),
        sum(r.cached_tokens for r in runs),
    )


async def _whole(
    runs: list[RequestRun], shaper: ResponseShaper, headers: dict[str, str]
) -> web.Response:
    async def drain(run: RequestRun) -> None:
        async for _ in run.tokens():
            pass

    await asyncio.gather(*(drain(r) for r in runs))
    body = shaper.full(runs[0].generated, "length", _summed(runs))
    body["choices"] = [
        {**shaper.full(r.generated, "length", {})["choices"][0], "index": i}
        for i, r in enumerate(runs)
    ]
    return web.json_response(body, headers=headers)


async def _stream(
    request: web.Request, runs: list[RequestRun], shaper: ResponseShaper, headers: dict[str, str]
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    merged: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(choice: int, run: RequestRun) -> None:
        index = 0
        try:
            async for n in run.tokens():
                for _ in range(n):
                    chunk = shaper.chunk(index, "length" if index == run.target - 1 else None)
                    chunk["choices"][0]["index"] = choice
                    await merged.put(sse(chunk))
                    index += 1
        except RequestError as exc:  # too late for a status code: an error event
            await merged.put(sse(error_body(exc.status, exc.message)))
        finally:
            await merged.put(None)

    pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    try:
        open_ = len(runs)
        while open_:
            item = await merged.get()
            if item is None:
                open_ -= 1
                continue
            await resp.write(item)
        if runs[0].req.include_usage:
            await resp.write(sse(shaper.usage_chunk(_summed(runs))))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left; serve_batch's cleanup aborts the prompts
    finally:
        for p in pumps:
            p.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pumps, return_exceptions=True)
    return resp
