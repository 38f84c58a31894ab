"""A completion request with a batch of prompts, served as one request per prompt, answered as one.

OpenAI's ``/v1/completions`` takes ``prompt`` as a list of texts or of token-id lists, and vLLM
answers such a batch as one response whose choices are numbered ``prompt_index * n +
choice_index``, with one id, summed usage and, when streamed, one usage chunk and one
``[DONE]``. Inside the engine every prompt is its own sequence, and so it is here: each prompt
goes through the whole proxy path on its own (admission, placement by its own cached prefix,
the pool's P/D protocol — a prefill's ``kv_transfer_params`` belong to one prompt), and this
module merges the answers into the engine's shape. Evaluation harnesses send such batches
(loglikelihood requests sharing a context), so each prompt reaching the instance that holds
its prefix is the point of splitting them.

All or nothing, as the engine answers a batch: if any prompt is refused (a 4xx or 5xx before its
answer starts), the others are abandoned (their engine legs aborted, as for a client that went
away) and the client gets that prompt's error. A streamed answer starts once every prompt's
answer has started, so that a refusal is still a plain error response. An error event in the
middle of one prompt's stream ends the whole stream after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from backends import json_codec
from gateway.answers import Scope, send_json
from gateway.openai import BadRequest, error_body
from gateway.relay import Receive, Send
from routing.prompt import PromptError
from routing.prompt_encoder import completion_prompt

log = logging.getLogger("kvgate.gateway")
App = Callable[[Scope, Receive, Send], Awaitable[None]]
_SUMMED_USAGE = ("prompt_tokens", "completion_tokens", "total_tokens")
_DONE = b"[DONE]"
# Response headers that say, per prompt, where it ran; joined in prompt order.
_PER_PROMPT_HEADERS = (b"x-kvgate-prefill", b"x-kvgate-decode")


def batch_of_prompts(body: dict[str, Any], limit: int) -> list[Any] | None:
    """The prompts of a batched completion request (a list of two or more texts or token-id
    lists), checked one by one before any is sent; None for a single prompt (a text, a token-id
    list or a batch of one, which the encoder takes as it is). Raises BadRequest naming the
    first bad prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None  # one prompt of token ids
    if len(prompt) > limit:
        raise BadRequest(
            f"'prompt' holds {len(prompt)} prompts; at most {limit} per request "
            "(server.max_batch_prompts)",
            "prompt",
        )
    kind = str if isinstance(prompt[0], str) else list
    for i, item in enumerate(prompt):
        if not isinstance(item, kind) or (
            kind is list and not all(isinstance(t, int) and not isinstance(t, bool) for t in item)
        ):  # OpenAI's schema (and vLLM) take no mix of the two
            raise BadRequest(
                f"prompt[{i}]: a batch is an array of strings or an array of token-id arrays",
                "prompt",
            )
        try:
            completion_prompt({"prompt": item})
        except PromptError as exc:
            raise BadRequest(f"prompt[{i}]: {exc}", "prompt") from None
    return prompt


@dataclass(slots=True)
class _Answer:
    """One prompt's answer as the proxy path sends it: its start, then its body pieces."""

    start: asyncio.Future[dict[str, Any]]
    pieces: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)

    def status(self) -> int:
        return self.start.result()["status"]


class BatchedCompletion:
    """Serves a batched completion through ``serve_one`` (the proxy's handler), one prompt
    each, and merges the answers."""

    def __init__(self, serve_one: App) -> None:
        self.serve_one = serve_one

    async def serve(
        self,
        scope: Scope,
        request_id: str,
        body: dict[str, Any],
        prompts: list[Any],
        receive: Receive,
        send: Send,
    ) -> None:
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()  # the client left, or the batch is abandoned
        answers = [_Answer(loop.create_future()) for _ in prompts]
        watcher = loop.create_task(_watch_client(receive, gone))
        tasks = [
            loop.create_task(
                self._one(scope, _sub_id(request_id, i), {**body, "prompt": p}, a, gone)
            )
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
        ]
        try:
            failed = await _first_refusal(answers)
            if failed is not None:
                gone.set()
                await _send_whole(send, failed, request_id)
            elif body.get("stream") is True:
                await self._stream(send, request_id, body, answers, gone)
            else:
                await _send_merged(send, request_id, body, answers)
        finally:
            gone.set()
            watcher.cancel()
            # Each prompt's path closes its own books when it sees the client gone.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(
        self, scope: Scope, rid: str, body: dict[str, Any], answer: _Answer, gone: asyncio.Event
    ) -> None:
        """One prompt through the proxy path, as a client of its own that sent ``body`` and
        leaves when the batch's client does (or the batch is abandoned)."""
        kept = [
            (k, v) for k, v in scope["headers"] if k not in (b"x-request-id", b"content-length")
        ]
        sub_scope = {**scope, "headers": [*kept, (b"x-request-id", rid.encode())]}
        raw = b""
        read = ended = False

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                if not answer.start.done():
                    answer.start.set_result(message)
                return
            if ended:
                return
            answer.pieces.put_nowait(message.get("body", b""))
            if not message.get("more_body"):
                ended = True
                answer.pieces.put_nowait(None)

        try:
            # In the try: whatever fails here, the batch hears a 500 and does not wait.
            raw = json_codec.dumps(body)  # integers beyond 64 bits too, as the body was parsed
            await self.serve_one(sub_scope, receive, send)
        except Exception:  # a bug: this prompt gets a 500 below, the log says why
            log.exception("batched completion: prompt %s failed", rid)
        finally:
            if not answer.start.done():  # it ended without an answer: a 500 of our own
                answer.start.set_result({"status": 500, "headers": []})
                if not ended:
                    msg = "the gateway failed to answer this prompt"
                    answer.pieces.put_nowait(error_body(msg, "server_error"))
            if not ended:
                answer.pieces.put_nowait(None)

    async def _stream(
        self,
        send: Send,
        request_id: str,
        body: dict[str, Any],
        answers: list[_Answer],
        gone: asyncio.Event,
    ) -> None:
        n = _choices_per_prompt(body)
        start = answers[0].start.result()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    *[(k, v) for k, v in start["headers"] if k == b"content-type"],
                    *_merged_headers(answers, request_id),
                ],
            }
        )
        merged: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, a, merged)) for i, a in enumerate(answers)]
        usage: dict[str, Any] | None = None
        usage_chunk: dict[str, Any] | None = None  # the first prompt's, for its other fields
        open_ = len(answers)
        batch_id = f"cmpl-{request_id}"
        try:
            while open_:
                i, event = await merged.get()
                if event is None:
                    open_ -= 1
                    continue
                out, usage_only, failed = _rewrite_event(event, i, n, batch_id)
                if usage_only is not None:
                    usage_chunk = usage_chunk or usage_only
                    usage = _add_usage(usage, usage_only["usage"])
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if failed:  # an error event: the batch ends with it
                    gone.set()
                    break
            tail = b""
            if usage_chunk is not None:
                chunk = {**usage_chunk, "id": batch_id, "usage": usage}
                tail = b"data: " + json_codec.dumps(chunk) + b"\n\n"
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})
        finally:
            for p in pumps:
                p.cancel()


async def _watch_client(receive: Receive, gone: asyncio.Event) -> None:
    with contextlib.suppress(OSError):
        while (await receive())["type"] != "http.disconnect":
            pass
    gone.set()


async def _first_refusal(answers: list[_Answer]) -> _Answer | None:
    """Waits until every answer has started; returns the first refused one (status >= 400) as
    soon as there is one."""
    pending = {a.start: a for a in answers}
    while pending:
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            answer = pending.pop(fut)
            if answer.status() >= 400:
                return answer
    return None


async def _body(answer: _Answer) -> bytes:
    parts = []
    while (piece := await answer.pieces.get()) is not None:
        parts.append(piece)
    return b"".join(parts)


async def _send_whole(send: Send, answer: _Answer, request_id: str) -> None:
    """A refused prompt's answer, as the batch's (its error says what went wrong)."""
    start = answer.start.result()
    headers = [(k, v) for k, v in start["headers"] if k not in (b"x-request-id", b"content-type")]
    await send_json(
        send,
        start["status"],
        await _body(answer),
        [*headers, (b"x-request-id", request_id.encode())],
    )


async def _send_merged(
    send: Send, request_id: str, body: dict[str, Any], answers: list[_Answer]
) -> None:
    n = _choices_per_prompt(body)
    merged: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    choices: list[Any] = []
    for i, answer in enumerate(answers):
        raw = await _body(answer)
        try:
            data = json_codec.loads(raw)
        except (ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            msg = f"the engine's answer to prompt[{i}] is not a JSON object"
            await send_json(
                send, 502, error_body(msg, "upstream_error"), _merged_headers(answers, request_id)
            )
            return
        merged = merged or data
        for choice in data.get("choices") or ():
            choice["index"] = i * n + int(choice.get("index", 0))
            choices.append(choice)
        if isinstance(data.get("usage"), dict):
            usage = _add_usage(usage, data["usage"])
    assert merged is not None
    merged["id"] = f"cmpl-{request_id}"
    merged["choices"] = choices
    if usage is not None:
        merged["usage"] = usage
    if "kv_transfer_params" in merged:  # one prompt's; meaningless for the batch
        merged["kv_transfer_params"] = None
    await send_json(send, 200, json_codec.dumps(merged), _merged_headers(answers, request_id))


async def _pump(i: int, answer: _Answer, merged: asyncio.Queue[tuple[int, bytes | None]]) -> None:
    """Cuts one prompt's SSE body into events (pieces may split or join them)."""
    buf = b""
    while (piece := await answer.pieces.get()) is not None:
        buf += piece.replace(b"\r\n", b"\n")
        *events, buf = buf.split(b"\n\n")
        for event in events:
            merged.put_nowait((i, event))
    if buf.strip():
        merged.put_nowait((i, buf))
    merged.put_nowait((i, None))


def _rewrite_event(
    event: bytes, i: int, n: int, batch_id: str
) -> tuple[bytes, dict[str, Any] | None, bool]:
    """(bytes to send, a usage-only chunk, whether it is an error event) for one SSE
    event of prompt ``i``: choices renumbered, the batch's id, ``[DONE]`` and usage-only chunks
    held back for the batch's end."""
    data = b"\n".join(line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data:  # a comment or keep-alive
        return event + b"\n\n", None, False
    if data == _DONE:
        return b"", None, False
    try:
        obj = json_codec.loads(data)
    except (ValueError, RecursionError):
        return event + b"\n\n", None, False
    if not isinstance(obj, dict):
        return event + b"\n\n", None, False
    if "error" in obj:
        return b"data: " + data + b"\n\n", None, True
    choices = obj.get("choices")
    if choices == [] and isinstance(obj.get("usage"), dict):
        return b"", obj, False
    for choice in choices or ():
        choice["index"] = i * n + int(choice.get("index", 0))
    obj["id"] = batch_id
    return b"data: " + json_codec.dumps(obj) + b"\n\n", None, False


def _add_usage(total: dict[str, Any] | None, part: dict[str, Any]) -> dict[str, Any]:
    """Usage summed over the prompts, as the engine sums it over a batch (cached tokens too)."""
    total = dict(total or {})
    for key, value in part.items():
        if key in _SUMMED_USAGE and isinstance(value, int):
            total[key] = int(total.get(key) or 0) + value
        elif key == "prompt_tokens_details" and isinstance(value, dict):
            details = dict(total.get(key) or {})
            for k, v in value.items():
                if isinstance(v, int) and not isinstance(v, bool):
                    details[k] = int(details.get(k) or 0) + v
            total[key] = details
        else:
            total.setdefault(key, value)
    return total


def _choices_per_prompt(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _merged_headers(answers: list[_Answer], request_id: str) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-request-id", request_id.encode())]
    for name in _PER_PROMPT_HEADERS:
        values = [v for a in answers for k, v in a.start.result()["headers"] if k == name]
        if values:
            headers.append((name, b",".join(values)))
    return headers


def _sub_id(request_id: str, i: int) -> str:
    """The i-th prompt's request id: the batch's with its index (kept under the 128 characters
    an id may have)."""
    return f"{request_id[:120]}-{i}"
