"""The OpenAI request and response shapes the emulator speaks (as vLLM / SGLang serve them).

Only what matters to a gateway is real: prompt length and content (for prefix caching),
``max_tokens``, streaming, usage and the P/D extension fields. Generated text is dummy
(" tok0 tok1 ..."): counts and timing matter, content does not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from routing.prompt import PromptError
from routing.prompt_encoder import CHAT_PATH, PromptEncoder, cache_salt
from routing.responses_input import responses_chat_body
from routing.tokenizer import unpack_token_ids

_MAX_TOKEN_ID = 1 << 32  # BlockHasher packs ids as uint32


class RequestError(Exception):
    """A request the emulator answers with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: ``{"error": {message, type, param, code}}`` with code = status."""
    kind = _ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """SGLang P/D: where the prefill's bootstrap server is and which room this request is."""

    host: str
    port: int | None
    room: int


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    chat: bool
    model: str | None
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    kv_transfer_params: dict[str, Any] | None
    bootstrap: Bootstrap | None
    # /v1/responses (served colocated: vLLM's Responses answer carries no kv_transfer_params)
    responses: bool = False
    previous_response: str | None = None
    cache_salt: str | None = None  # vLLM's per-request prefix-cache namespace


def _encoded(encoder: PromptEncoder, path: str, body: dict[str, Any]) -> list[int]:
    """The prompt's tokens exactly as the gateway computes them (same encoder, same model)."""
    try:
        return unpack_token_ids(encoder.encode(path, body).packed)
    except PromptError as exc:
        raise RequestError(400, str(exc), exc.param) from None


def _token_list(value: list[Any], param: str) -> list[int]:
    for t in value:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < _MAX_TOKEN_ID:
            raise RequestError(400, f"{param} token ids must be integers in [0, 2^32)", param)
    return value


def _prompt_tokens(body: dict[str, Any], chat: bool, encoder: PromptEncoder) -> list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        return _encoded(encoder, CHAT_PATH, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encoded(encoder, "/v1/completions", body) if prompt else []
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return _token_list(prompt, "prompt")
    raise RequestError(400, "prompt must be a string or a list of token ids", "prompt")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(400, f"{key} must be an integer >= 1", key)
    return value


def _stream_flag(body: dict[str, Any]) -> bool:
    stream = body.get("stream")
    if stream is None:  # vLLM: boolean or null, default false
        return False
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be a boolean", "stream")
    return stream


def _bootstrap(body: dict[str, Any]) -> Bootstrap | None:
    room = body.get("bootstrap_room")
    if room is None:
        return None
    host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
    if isinstance(room, list):  # batch form; one item only, like the prompt
        if len(room) != 1:
            raise RequestError(400, "batched bootstrap rooms are not supported", "bootstrap_room")
        room = room[0]
        host = host[0] if isinstance(host, list) and host else host
        port = port[0] if isinstance(port, list) and port else port
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise RequestError(400, "bootstrap_room must be a non-negative integer", "bootstrap_room")
    if not isinstance(host, str) or not host:
        raise RequestError(400, "bootstrap_host must be a string", "bootstrap_host")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool)):
        raise RequestError(400, "bootstrap_port must be an integer or null", "bootstrap_port")
    return Bootstrap(host, port, room)


def parse_responses_request(
    body: Any, *, encoder: PromptEncoder, default_max_tokens: int
) -> ParsedRequest:
    """A ``/v1/responses`` body, parsed as the chat request the engine renders it as."""
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    _positive_int(body, "max_output_tokens")  # named in its own error, not as max_tokens
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RequestError(400, "previous_response_id must be a string", "previous_response_id")
    try:
        chat = responses_chat_body(body)
    except PromptError as exc:
        raise RequestError(400, str(exc), exc.param) from None
    req = parse_request(
        {**chat, "model": body.get("model")},
        chat=True,
        encoder=encoder,
        default_max_tokens=default_max_tokens,
    )
    return replace(req, responses=True, previous_response=previous)


def parse_request(
    body: Any, *, chat: bool, encoder: PromptEncoder, default_max_tokens: int
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    tokens = _prompt_tokens(body, chat, encoder)
    if not tokens:
        raise RequestError(400, "the prompt is empty", "messages" if chat else "prompt")
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(400, "only n=1 is supported by the emulator", "n")
    # Chat's newer name wins over the deprecated one, as in the OpenAI API.
    max_tokens = _positive_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _positive_int(body, "max_tokens") or default_max_tokens
    stream = _stream_flag(body)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "stream_options must be an object", "stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise RequestError(400, "kv_transfer_params must be an object", "kv_transfer_params")
    model = body.get("model")
    try:
        salt = cache_salt(body)
    except PromptError as exc:
        raise RequestError(400, str(exc), exc.param) from None
    return ParsedRequest(
        chat=chat,
        model=model if isinstance(model, str) else None,
        token_ids=tokens,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        kv_transfer_params=kv,
        bootstrap=_bootstrap(body),
        cache_salt=salt,
    )


def token_text(index: int) -> str:
    return f" tok{index}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseShaper:
    """Builds one request's response objects (non-streaming body or SSE chunks)."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, index: int, finish_reason: str | None) -> dict[str, Any]:
        """The chunk of generated token ``index`` (one chunk per token)."""
        text = token_text(index)
        if self.chat:
            # The role rides on the first token's delta (no separate empty role chunk), so
            # every chunk is exactly one token.
            delta = {"role": "assistant", "content": text} if index == 0 else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_obj: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_obj}

    def full(self, tokens: int, finish_reason: str, usage_obj: dict[str, Any]) -> dict[str, Any]:
        text = "".join(token_text(i) for i in range(tokens))
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage_obj}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_obj}
