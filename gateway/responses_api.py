"""OpenAI's Responses API (``POST /v1/responses``) through the proxy path, as vLLM and llama.cpp
serve it.

The engine renders a Responses body as chat messages through the model's chat template;
``routing/responses_input.py`` renders it the same way, so that the request gets its prompt
identity (tokens, blocks) and its max tokens (``max_output_tokens``) from the chat path; the
body forwarded is the client's, unchanged.

A Responses stream is not a chat stream: ``response.created`` and ``response.in_progress`` come
before any token, and each token is a ``*.delta`` event (``TOKEN_MARK``); the answer's usage
says ``input_tokens``/``output_tokens`` (gateway/relay.py reads both namings).

``previous_response_id``: only the engine that stored a response can continue it (vLLM keeps it
in its own memory, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``), so ``ResponseOwners`` remembers
which instance made each response and the follow-up is placed there. With several gateway
replicas, each publishes the owners it learns to the others (gateway/replica_owners.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from config.settings import EngineKind, InstanceSettings, Role
from gateway.openai import CHAT, BadRequest, ParsedRequest, RequestHead
from gateway.proxy_deps import ProxyGateway
from gateway.response_owners import ResponseOwners
from routing.prompt import PromptError
from routing.responses_input import responses_chat_body

RESPONSES = "/v1/responses"
# A token event of a Responses stream: "response.output_text.delta", "...reasoning_text.delta",
# "...function_call_arguments.delta" (the end of the JSON "type" value, compact or spaced).
TOKEN_MARK = b'.delta"'
_FIRST_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,200})"')


def previous_response(body: Mapping[str, Any]) -> str | None:
    value = body.get("previous_response_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(
            "'previous_response_id' must be a non-empty string", "previous_response_id"
        )
    return value


def response_id(answer: bytes) -> str | None:
    """The response's id: the first ``"id"`` of a whole answer, or of a stream's first chunk
    (``response.created`` carries the response, whose first field is its id)."""
    found = _FIRST_ID.search(answer, 0, 4096)
    return found.group(1).decode() if found else None


class ResponsesRoute:
    """The Responses API's part of the proxy path: the prompt it is placed by, the instance a
    follow-up must go to, and what each answer teaches (which instance made which response)."""

    def __init__(
        self, specs: Mapping[str, InstanceSettings], owners: ResponseOwners | None = None
    ) -> None:
        self.specs = specs  # the gateway's live instances (membership changes show here)
        self.owners = owners if owners is not None else ResponseOwners()

    def prompt(self, head: RequestHead) -> tuple[RequestHead, frozenset[str]]:
        """The head to parse the prompt from (the chat body the engine renders) and the
        instances this request must not be placed on; raises BadRequest."""
        model = head.route.name if head.route is not None else None
        mine = [s for s in self.specs.values() if model is None or s.model == model]
        if any(s.role is not Role.BOTH for s in mine):
            raise BadRequest(
                "/v1/responses is served by colocated pools only: a prefill/decode pair cannot "
                "hand it over (vLLM's Responses answer carries no kv_transfer_params); use "
                "/v1/chat/completions",
                "model",
            )
        # vLLM adds the tokenizer's special tokens to a Responses prompt, llama.cpp does not.
        special = not any(s.engine is EngineKind.LLAMACPP for s in mine)
        try:
            chat = replace(head, body=responses_chat_body(head.body, special))
        except PromptError as exc:
            raise BadRequest(str(exc), exc.param) from None
        previous = previous_response(head.body)
        owner = self.owners.owner(previous) if previous is not None else None
        if owner is None or owner not in self.specs:
            # Not made through this gateway (or its engine left the fleet, the response with
            # it): placed as any request, the engine answers for it.
            return chat, frozenset()
        return chat, frozenset(i for i in self.specs if i != owner)

    async def parse(
        self, gw: ProxyGateway, raw: bytes, headers: Mapping[str, str], request_id: str
    ) -> tuple[ParsedRequest, frozenset[str]]:
        """The request as the core needs it (its prompt the rendered chat, its body the
        client's) and the instances it must not be placed on; raises BadRequest."""
        head = gw.parse_head(raw)
        chat, exclude = self.prompt(head)
        await gw.tokenize_ahead(CHAT, chat)
        parsed = gw.parse_prompt(CHAT, chat, headers, request_id)
        parsed.body = head.body  # what is forwarded
        return parsed, exclude

    def answered(self, instance_id: str, answer: bytes) -> None:
        """A whole answer, or a stream's first chunk, came from ``instance_id``."""
        made = response_id(answer)
        if made is not None:
            self.owners.remember(made, instance_id)
