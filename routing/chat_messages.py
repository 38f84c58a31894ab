"""OpenAI chat messages and tools turned into what vLLM hands its chat template.

vLLM (0.32, ``renderers/chat_utils.py``) rebuilds every message before rendering: content
becomes one string (text parts joined by newlines) or, for templates that loop over content
parts, a list of ``{"type": "text", "text": ...}``; only role, content, name, tool calls
(arguments parsed into objects), tool_call_id and reasoning survive; ``developer`` becomes
``system`` when the template does not know it. Tools are passed as their serialized request
model (``description``/``parameters`` present, ``None`` when absent). Token ids depend on every
character of that, so the gateway rebuilds it the same way. Media parts are skipped: a
text-only model's engine rejects them, and for a multimodal one kvgate is approximate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from routing.chat_template import ContentFormat
from routing.prompt import PromptError

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this per-request line from system


def engine_conversation(
    messages: Any, content_format: ContentFormat, *, developer_role: bool
) -> list[dict[str, Any]]:
    """The conversation vLLM renders; raises ``PromptError`` naming the bad field."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty array", "messages")
    out = [_message(i, m, content_format) for i, m in enumerate(messages)]
    if not developer_role and any(m["role"] == "developer" for m in out):
        out = _developer_as_system(out)
    return out


def engine_tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise PromptError("'tools' must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise PromptError(f"tools[{i}].function.name must be a string", f"tools[{i}]")
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        defer = tool.get("defer_loading", fn.get("defer_loading"))
        for key, value in (("strict", fn.get("strict")), ("defer_loading", defer)):
            if value is not None:
                function[key] = value
        item: dict[str, Any] = {"type": "function", "function": function}
        if tool.get("defer_loading") is not None:
            item["defer_loading"] = tool["defer_loading"]
        out.append(item)
    return out


def _message(i: int, msg: Any, content_format: ContentFormat) -> dict[str, Any]:
    if not isinstance(msg, Mapping):
        raise PromptError(f"messages[{i}] must be an object", f"messages[{i}]")
    role = msg.get("role")
    if not isinstance(role, str):
        raise PromptError(f"messages[{i}].role must be a string", f"messages[{i}].role")
    parts = _parts(i, msg.get("content"), role)
    content: Any
    if content_format == "openai":
        content = [{"type": "text", "text": text} for text in parts]
    else:
        content = "\n".join(parts)
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None and (parsed := _tool_calls(i, calls)) is not None:
            out["tool_calls"] = parsed
        reasoning = msg.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(content, list):  # vLLM flattens tool results for every template
            out["content"] = "\n".join(p["text"] for p in content)
    if isinstance(msg.get("name"), str):
        out["name"] = msg["name"]
    if isinstance(msg.get("task"), str):
        out["task"] = msg["task"]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def _parts(i: int, content: Any, role: str) -> list[str]:
    """The text of each text part, in order."""
    if content is None:
        return []
    if isinstance(content, str):  # the common case, taken straight (one text part)
        if role == "system" and content.startswith(_BILLING_HEADER):
            content = content.partition("\n")[2]
            return [content] if content else []
        return [content]
    param = f"messages[{i}].content"
    if isinstance(content, list):
        items: Sequence[Any] = content
    else:
        raise PromptError(f"{param} must be a string or an array", param)
    out: list[str] = []
    for part in items:
        if isinstance(part, str):
            text = part
        elif isinstance(part, Mapping):
            key = _TEXT_PARTS.get(part.get("type"))  # type: ignore[arg-type]
            if key is None:
                continue  # media: see the module docstring
            text = part.get(key)
            if text is None:
                continue  # vLLM skips text parts without text
            if not isinstance(text, str):
                raise PromptError(f"{param} text parts must hold strings", param)
        else:
            raise PromptError(f"{param} parts must be objects or strings", param)
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        out.append(text)
    return out


def _tool_calls(i: int, calls: Any) -> list[Any] | None:
    if not isinstance(calls, list):
        raise PromptError(f"messages[{i}].tool_calls must be an array", f"messages[{i}]")
    if not calls:
        return None  # vLLM drops an empty list
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise PromptError(
                "assistant tool_calls entries must be function calls", f"messages[{i}].tool_calls"
            )
        # vLLM validates calls into OpenAI's TypedDicts, which puts the known keys first in
        # their declared order (id, function, type; arguments, name), then any others; a
        # template's tojson shows that order.
        fn = _ordered(fn, ("arguments", "name"))
        fn["arguments"] = _arguments(fn.get("arguments"))
        out.append(_ordered({**call, "function": fn}, ("id", "function", "type")))
    return out


def _ordered(obj: Mapping[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
    out = {k: obj[k] for k in first if k in obj}
    out.update((k, v) for k, v in obj.items() if k not in out)
    return out


def _arguments(raw: Any) -> Any:
    """Templates expect arguments as an object: parse JSON text; anything else -> ``{}``."""
    if not raw:
        return {}
    if isinstance(raw, Mapping):
        return raw
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for msg in conversation:
        if msg["role"] == "developer":
            msg = {k: v for k, v in msg.items() if k != "tools"}
            msg["role"] = "system"
        converted.append(msg)
    systems: list[str] = []
    rest: list[dict[str, Any]] = []
    merge = False
    for i, msg in enumerate(converted):
        if msg["role"] != "system":
            rest.append(msg)
            continue
        merge = merge or i > 0 or bool(systems)
        content = msg.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]
