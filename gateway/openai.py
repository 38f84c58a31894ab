"""The OpenAI surface: parse a completion request into the core's ``RequestInfo``; shape errors.

Only what the scheduler needs is read from the body (prompt tokens, max tokens, stream); the
body itself is forwarded unchanged. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from config.settings import Settings
from routing.hashing import BlockHasher
from routing.prompt import PromptError, chat_prompt_text
from routing.tokenizer import Tokenizer
from routing.types import RequestInfo

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_TOKEN_ID_LIMIT = 1 << 32  # block hashing packs ids as uint32


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None):
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def prompt_blocks(
    path: str, body: Mapping[str, Any], tokenizer: Tokenizer, hasher: BlockHasher
) -> tuple[tuple[int, ...], int]:
    """``(block hashes, prompt token count)`` of the request's prompt."""
    if path == CHAT:
        try:
            text = chat_prompt_text(body.get("messages"))
        except PromptError as exc:
            raise BadRequest(str(exc), exc.param) from None
        return hasher.hash_text(text, tokenizer)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        return hasher.hash_text(prompt, tokenizer)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(0 <= t < _TOKEN_ID_LIMIT for t in prompt):
            raise BadRequest("token ids must be in [0, 2^32)", "prompt")
        return hasher.hash_tokens(prompt), len(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise BadRequest("batched prompts are not supported; send one prompt per request", "prompt")
    raise BadRequest("'prompt' must be a string or an array of token ids", "prompt")


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"'{key}' must be a positive integer", key)
    return value


def _header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"header {name} must be a number of milliseconds", name) from None
    if not value > 0:
        raise BadRequest(f"header {name} must be > 0", name)
    return value / 1000.0


@dataclass(slots=True)  # per request: not frozen (see routing/types.py)
class ParsedRequest:
    info: RequestInfo
    body: dict[str, Any]
    stream: bool


def parse_request(
    path: str,
    raw: bytes,
    headers: Mapping[str, str],
    request_id: str,
    now: float,
    *,
    settings: Settings,
    tokenizer: Tokenizer,
    hasher: BlockHasher,
) -> ParsedRequest:
    """``headers`` keys are lower-case."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    blocks, n_tokens = prompt_blocks(path, body, tokenizer, hasher)
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    priority = headers.get("x-kvgate-priority")
    if priority is not None:
        names = [p.name for p in settings.slo.priorities]
        if priority not in names:
            raise BadRequest(
                f"unknown priority {priority!r} (known: {', '.join(names)})",
                "x-kvgate-priority",
            )
    info = RequestInfo(
        request_id=request_id,
        prompt_tokens=n_tokens,
        block_hashes=blocks,
        max_tokens=max_tokens or settings.predictors.default_output_tokens,
        arrival_s=now,
        priority=priority,
        slo_ttft_s=_header_ms(headers, "x-slo-ttft-ms"),
        slo_tbt_s=_header_ms(headers, "x-slo-tbt-ms"),
        output_key=blocks[0] if blocks else None,
    )
    return ParsedRequest(info, body, stream)
