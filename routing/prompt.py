"""The text a chat request's KV prefix is made of, shared by the gateway and the emulator.

This is the approximate rendering (no ``routing.model_dir``): a text in which a longer
conversation starts with a shorter one's (a shared system prompt gives a shared token prefix),
rendered the same way by the emulator so cache views agree. With a model directory the engine's
own chat template is used instead (routing/prompt_encoder.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from config.errors import KvgateError


class PromptError(KvgateError, ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def chat_prompt_text(messages: Any) -> str:
    """Message contents joined by newlines (text parts of multi-part contents)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array", "messages")
    parts = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise PromptError(f"messages[{i}] must be an object", f"messages[{i}]")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            parts.append(content or "")
        elif isinstance(content, list):
            parts.append("".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping)))
        else:
            raise PromptError(
                f"messages[{i}].content must be a string or an array", f"messages[{i}].content"
            )
    return "\n".join(parts)


# What opens a generated-token event in an OpenAI SSE stream, compact and spaced JSON.
TOKEN_EVENT = b'"choices":[{'
TOKEN_EVENT_SPACED = b'"choices": [{'


def count_stream_tokens(chunk: bytes) -> int:
    """Generated-token events in a chunk of an OpenAI SSE stream: events with a non-empty
    ``choices`` array (the usage-only event and ``[DONE]`` do not count)."""
    # An engine writes either compact or spaced JSON, never both in one stream.
    return chunk.count(TOKEN_EVENT) or chunk.count(TOKEN_EVENT_SPACED)
