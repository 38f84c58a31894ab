"""A Responses API body (``POST /v1/responses``) as the chat body its engine renders.

The engine turns ``instructions`` and ``input`` into chat messages and applies the model's chat
template (vLLM's ``construct_input_messages`` and ``construct_chat_messages_with_tool_call``):
``instructions`` become a system message, a string ``input`` one user message, and input items
messages of their own (role items as they are, text parts read as text; a function call as the
assistant's tool call, merged into the assistant message before it; its output as a tool
message). Function tools are shown to the template in the chat shape. The gateway places the
request, and the emulator caches it, by this chat body's prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.prompt import PromptError

_FUNCTION_CALL = "function_call"
_CALL_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def responses_chat_body(body: Mapping[str, Any], special_tokens: bool = True) -> dict[str, Any]:
    """The chat completion body the engine renders this Responses body as (its prompt and
    max tokens; not the rest of the request); raises PromptError where the engine refuses.
    ``special_tokens``: the engine tokenizes the rendered prompt with the tokenizer's special
    tokens, as vLLM 0.32 does for this API (not for chat completions: one more BOS on
    Llama-style templates, 624 tokens where the same messages as a chat completion are 623);
    llama.cpp does not (154 both ways)."""
    if "input" not in body:
        raise PromptError("'input' is required: a string or a list of input items", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise PromptError("'instructions' must be a string", "instructions")
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages.extend(_input_messages(given))
    else:
        raise PromptError("'input' must be a string or a list of input items", "input")
    out: dict[str, Any] = {"messages": messages, "add_special_tokens": special_tokens}
    if _partial(given):  # a partial assistant turn is continued, not answered
        out |= {"add_generation_prompt": False, "continue_final_message": True}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    tools = _chat_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    for key in ("chat_template_kwargs", "cache_salt", "stream"):
        if key in body:
            out[key] = body[key]
    if (limit := body.get("max_output_tokens")) is not None:
        out["max_tokens"] = limit
    return out


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """vLLM's ``construct_chat_messages_with_tool_call`` for the item kinds that carry text."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise PromptError(f"'input[{i}]' must be an object", "input")
        kind = item.get("type")
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind == _FUNCTION_CALL:
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if last is not None and isinstance(last.get("tool_calls"), list):
                last["tool_calls"].append(call)
            elif last is not None and "tool_calls" not in last:
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind in _CALL_OUTPUTS:
            messages.append(
                {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
            )
        elif "role" in item:
            message = {k: v for k, v in item.items() if k not in ("type", "id", "status")}
            if item.get("role") == "assistant" and last is not None and "content" not in last:
                last["content"] = _first_text(item.get("content"))  # after its tool calls
            else:
                messages.append(message)
        # Reasoning and built-in tool items are left out: the prompt is the engine's up to
        # that item (its cached blocks past it are not found).
    if not messages:
        raise PromptError("'input' holds no message", "input")
    return messages


def _partial(given: Any) -> bool:
    """vLLM's ``should_continue_final_message``: the last item is a message (or reasoning)
    still ``in_progress`` or ``incomplete``."""
    if not isinstance(given, list) or not given or not isinstance(given[-1], Mapping):
        return False
    last = given[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def _first_text(content: Any) -> Any:
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        return content[0].get("text")
    return content


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape the template expects (vLLM's
    ``convert_tool_responses_to_completions_format``); built-in tools are not shown to it."""
    if not isinstance(tools, list):
        return None
    out = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
        if isinstance(tool, Mapping) and tool.get("type") == "function"
    ]
    return out or None
