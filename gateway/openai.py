"""The OpenAI surface: parse a completion request into the core's ``RequestInfo``; shape errors.

Only what the scheduler needs is read from the body (prompt tokens, max tokens, stream); the
body itself is forwarded unchanged. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends import json_codec
from config.settings import Settings
from gateway.models import ModelRoute
from routing.hashing import BlockHasher
from routing.prompt import PromptError
from routing.prompt_encoder import CHAT_PATH, PromptEncoder, PromptTokens
from routing.types import RequestInfo

COMPLETIONS = "/v1/completions"
CHAT = CHAT_PATH


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def served_route(body: Mapping[str, Any], routes: Mapping[str, ModelRoute]) -> ModelRoute:
    """The route of the model the body names; 404 ``model_not_found`` as OpenAI answers."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' must name a served model (see GET /v1/models)", "model")
    route = routes.get(name)
    if route is None:
        raise BadRequest(
            f"The model `{name}` does not exist (served: {', '.join(sorted(routes))})",
            "model",
            status=404,
            code="model_not_found",
        )
    return route


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None):
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def prompt_blocks(
    path: str,
    body: Mapping[str, Any],
    encoder: PromptEncoder,
    hasher: BlockHasher,
    lora: str | None = None,
) -> tuple[tuple[int, ...], PromptTokens]:
    """``(block hashes, prompt tokens)`` of the request's prompt (under LoRA adapter ``lora``)."""
    try:
        tokens = encoder.encode(path, body)
    except PromptError as exc:
        raise BadRequest(str(exc), exc.param) from None
    except UnicodeEncodeError:  # found here, not looked for on every request (hot path)
        main = "messages" if path == CHAT else "prompt"
        field = main if lone_surrogate({main: body.get(main)}) else lone_surrogate(body) or main
        raise BadRequest(
            f"'{field}' holds a lone UTF-16 surrogate (\\uD800-\\uDFFF without its pair), "
            "which is not Unicode text",
            field,
        ) from None
    if tokens.cache_salt is None and lora is None:
        return hasher.hash_packed(tokens.packed), tokens
    # A salted prompt's or an adapter's blocks live in their own key space, as in the engine.
    root = hasher.namespace_root(lora, tokens.cache_salt)
    return hasher.hash_packed(tokens.packed, root), tokens


def lone_surrogate(body: Mapping[str, Any]) -> str | None:
    """The top-level field of ``body`` holding a string with a lone UTF-16 surrogate, if any:
    JSON's ``\\ud800`` escapes (and json.loads of bytes, which decodes "surrogatepass") give
    strings that are not Unicode text, that no tokenizer takes and that cannot be encoded as
    UTF-8. Iterative: the body may nest as deep as the JSON parser allows."""
    for key, value in body.items():
        stack: list[Any] = [key, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode()
                except UnicodeEncodeError:  # the key itself may be the bad string
                    return key.encode("utf-8", "backslashreplace").decode()
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


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
    if not (value > 0 and math.isfinite(value)):  # inf would make every timeout infinite
        raise BadRequest(f"header {name} must be a finite number > 0", name)
    return value / 1000.0


@dataclass(slots=True)  # per request: not frozen (see routing/types.py)
class ParsedRequest:
    info: RequestInfo
    body: dict[str, Any]
    stream: bool
    # The prompt as encoded for hashing (kept: a warm-up copy sends these ids) and whether
    # the encoder was engine-exact.
    tokens: PromptTokens | None = None
    exact: bool = False


@dataclass(slots=True)
class RequestHead:
    """A completion body parsed up to its prompt: what is known before tokenizing it."""

    body: dict[str, Any]
    stream: bool
    route: ModelRoute | None  # config ``models``: the model the body names
    size: int  # bytes of JSON: at least the characters of the prompt's text


def parse_head(
    raw: bytes,
    models: Mapping[str, ModelRoute] | None = None,
    adapters: Mapping[str, ModelRoute] | None = None,
) -> RequestHead:
    """The JSON body, ``stream`` and the model's route; raises BadRequest (these are the
    first checks of ``parse_request``, in its order). Without ``models`` (one unnamed model)
    the route is None, or the LoRA adapter's among ``adapters`` that the body names."""
    try:
        body = json_codec.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    stream = body.get("stream")
    if stream is None:  # OpenAI's and vLLM's schema: boolean or null, default false
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    route = None
    if models:
        route = served_route(body, models)
    elif adapters and isinstance(name := body.get("model"), str):
        route = adapters.get(name)
    return RequestHead(body, stream, route, len(raw))


def head_info(
    path: str,
    head: RequestHead,
    headers: Mapping[str, str],
    request_id: str,
    now: float,
    settings: Settings,
) -> RequestInfo | None:
    """The request as far as it is known without its prompt tokens (0 tokens, no blocks),
    for a decision that needs none (``Conductor.reject_hopeless``); None when the prompt
    field is missing or a header is invalid: ``parse_prompt`` then answers the error, in
    ``parse_request``'s order."""
    if ("messages" if path == CHAT else "prompt") not in head.body:
        return None
    priority = headers.get("x-kvgate-priority")
    if priority is not None and priority not in {p.name for p in settings.slo.priorities}:
        return None
    try:
        ttft, tbt = _header_ms(headers, "x-slo-ttft-ms"), _header_ms(headers, "x-slo-tbt-ms")
    except BadRequest:
        return None
    return RequestInfo(
        request_id=request_id,
        prompt_tokens=0,
        block_hashes=(),
        max_tokens=settings.predictors.default_output_tokens,
        arrival_s=now,
        priority=priority,
        slo_ttft_s=ttft,
        slo_tbt_s=tbt,
        model=head.route.name if head.route is not None else None,
    )


def parse_request(
    path: str,
    raw: bytes,
    headers: Mapping[str, str],
    request_id: str,
    now: float,
    *,
    settings: Settings,
    encoder: PromptEncoder,
    hasher: BlockHasher,
    models: Mapping[str, ModelRoute] | None = None,
) -> ParsedRequest:
    """``headers`` keys are lower-case. With ``models`` (config ``models``: name or alias ->
    route) the body's ``model`` picks the encoder and key space, and the request is placed
    only on that model's instances."""
    head = parse_head(raw, models)
    return parse_prompt(
        path, head, headers, request_id, now, settings=settings, encoder=encoder, hasher=hasher
    )


def parse_prompt(
    path: str,
    head: RequestHead,
    headers: Mapping[str, str],
    request_id: str,
    now: float,
    *,
    settings: Settings,
    encoder: PromptEncoder,
    hasher: BlockHasher,
) -> ParsedRequest:
    """The rest of ``parse_request`` after ``parse_head``: the prompt's tokens and blocks,
    max tokens, priority and SLO headers. The head's model route, if any, picks the encoder
    and key space over ``encoder`` and ``hasher``."""
    body, model, lora = head.body, None, None
    if head.route is not None:
        route = head.route
        encoder, hasher, model, lora = route.encoder, route.hasher, route.name, route.lora
    blocks, tokens = prompt_blocks(path, body, encoder, hasher, lora)
    n_tokens = tokens.n_tokens
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
        model=model,
        lora=lora,
    )
    return ParsedRequest(info, body, head.stream, tokens, encoder.exact)
