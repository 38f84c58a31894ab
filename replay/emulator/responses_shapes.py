"""The Responses API's answers as vLLM 0.32 writes them (``/v1/responses``), for the emulator.

A whole answer is a ``response`` object (its id first, the generated message in ``output``,
usage as ``input_tokens``/``output_tokens`` with ``input_tokens_details.cached_tokens``). A
stream is SSE with an ``event:`` line per event: ``response.created`` and
``response.in_progress`` as soon as it starts, then with the first token
``response.output_item.added`` and ``response.content_part.added``, one
``response.output_text.delta`` per token, and at the end the ``.done`` events and
``response.completed`` holding the whole response. No ``[DONE]``. An answer cut by
``max_output_tokens`` is ``"incomplete"`` (reason ``max_output_tokens``), as vLLM marks it.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import Any

from replay.emulator.openai_api import token_text


def responses_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponsesShaper:
    """One request's Responses answer: the whole object, or its SSE events in order."""

    def __init__(self, request_id: str, model: str, previous: str | None, limit: int) -> None:
        self.id = f"resp_{request_id}"
        self.item = f"msg_{request_id}"
        self.model = model
        self.previous = previous
        self.limit = limit
        self.created = int(time.time())
        self._seq = 0

    def response(self, tokens: int, usage: dict[str, Any] | None, done: bool) -> dict[str, Any]:
        """The response object, its fields in vLLM's order."""
        cut = done and tokens >= self.limit
        status = ("incomplete" if cut else "completed") if done else "in_progress"
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": None,
            "metadata": None,
            "model": self.model,
            "object": "response",
            "output": [self._message(tokens, "completed")] if done else [],
            "parallel_tool_calls": True,
            "temperature": 1.0,
            "tool_choice": "none",
            "tools": [],
            "top_p": 1.0,
            "background": False,
            "max_output_tokens": self.limit,
            "max_tool_calls": None,
            "previous_response_id": self.previous,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": status,
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _message(self, tokens: int | None, status: str) -> dict[str, Any]:
        content = [] if tokens is None else [self._part(tokens)]
        return {
            "id": self.item,
            "content": content,
            "role": "assistant",
            "status": status,
            "type": "message",
            "phase": None,
        }

    def _part(self, tokens: int) -> dict[str, Any]:
        text = "".join(token_text(i) for i in range(tokens))
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {**fields, "sequence_number": self._seq, "type": kind}
        self._seq += 1
        return (
            f"event: {kind}\ndata: ".encode()
            + json.dumps(data, separators=(",", ":")).encode()
            + b"\n\n"
        )

    def opening(self) -> bytes:
        """What the stream starts with, before any token."""
        start = self.response(0, None, done=False)
        return self.event("response.created", response=start) + self.event(
            "response.in_progress", response=start
        )

    def token(self, index: int) -> bytes:
        """Token ``index``'s event; the first opens the output message."""
        out = b""
        if index == 0:
            item = self._message(None, "in_progress")
            out = self.event("response.output_item.added", item=item, output_index=0) + self.event(
                "response.content_part.added",
                content_index=0,
                item_id=self.item,
                output_index=0,
                part={"annotations": [], "text": "", "type": "output_text", "logprobs": []},
            )
        return out + self.event(
            "response.output_text.delta",
            content_index=0,
            delta=token_text(index),
            item_id=self.item,
            logprobs=[],
            output_index=0,
        )

    def closing(self, tokens: int, usage: dict[str, Any]) -> bytes:
        """The ``.done`` events and ``response.completed``."""
        part = self._part(tokens)
        out = b""
        if tokens:
            out = (
                self.event(
                    "response.output_text.done",
                    content_index=0,
                    item_id=self.item,
                    logprobs=[],
                    output_index=0,
                    text=part["text"],
                )
                + self.event(
                    "response.content_part.done",
                    content_index=0,
                    item_id=self.item,
                    output_index=0,
                    part=part,
                )
                + self.event(
                    "response.output_item.done",
                    item=self._message(tokens, "completed"),
                    output_index=0,
                )
            )
        return out + self.event("response.completed", response=self.response(tokens, usage, True))


class StoredResponses:
    """The response ids this engine made (the most recent ``limit``): vLLM, with its store on,
    continues only those (``previous_response_id``) and answers 404 for any other."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, response_id: str) -> None:
        self._ids[response_id] = None
        if len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._ids
