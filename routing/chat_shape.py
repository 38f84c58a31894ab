"""A conversation's shape (what a chat skeleton is keyed by) and its variable values.

The shape is everything a chat template may branch on: the roles and keys of the messages in
order, which texts are empty, how many text parts and tool calls each message has, the tool
calls' types, ``add_generation_prompt``, the template kwargs and the tools offered (packed).
The values are the texts (contents, text parts, names, tool call ids, function names) and the
tool calls' parsed arguments, in one order that ``probe_conversation`` numbers its slots by.
Messages are taken as ``routing/chat_messages.py`` rebuilds them for the engine; anything else
(reasoning, a developer's tools, media parts, an unusual call) has no shape: the template
renders it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from routing.chat_probes import ArgumentsProbe, TextProbe, marker

_SCALARS = (str, int, float, bool, type(None))
_TEXT_KEYS = frozenset({"name", "tool_call_id"})
_CALL_KEYS = frozenset({"id", "function", "type"})

Shape = tuple[Any, ...]


def conversation_shape(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    extra: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None,
) -> tuple[Shape, list[Any]] | None:
    """The shape's key and the values in slot order; None when no skeleton can stand for it."""
    values: list[Any] = []
    shape: list[Any] = []
    for m in messages:
        if type(m.get("role")) is not str:
            return None
        keys: list[Any] = []
        for key, value in m.items():
            if key == "role":
                keys.append(value)
            elif key == "content":
                if (content := _content(value, values)) is None:
                    return None
                keys.append(content)
            elif key in _TEXT_KEYS and type(value) is str:
                values.append(value)
                keys.append((key, value != ""))
            elif key == "tool_calls" and type(value) is list:
                if (calls := _calls(value, values)) is None:
                    return None
                keys.append(calls)
            else:
                return None
        shape.append(tuple(keys))
    for value in extra.values():
        if not isinstance(value, _SCALARS):
            return None
    offered = None
    if tools is not None:
        try:  # msgpack: ~4x faster than json.dumps, and as exact about the values
            offered = msgpack.packb(tools)
        except (TypeError, ValueError, OverflowError):
            return None
    return (add_generation_prompt, tuple(shape), tuple(sorted(extra.items())), offered), values


def _content(content: Any, values: list[Any]) -> Any:
    if type(content) is str:
        values.append(content)
        return content != ""
    if type(content) is not list:
        return None
    empty = []
    for part in content:  # vLLM's "openai" content format: [{"type": "text", "text": ...}]
        if type(part) is not dict or len(part) != 2 or part.get("type") != "text":
            return None
        text = part.get("text")
        if type(text) is not str:
            return None
        values.append(text)
        empty.append(text != "")
    return ("parts", tuple(empty))


def _calls(calls: list[Any], values: list[Any]) -> Any:
    out: list[Any] = []
    for call in calls:
        if type(call) is not dict or not _CALL_KEYS.issuperset(call):
            return None
        keys: list[Any] = []
        for key, value in call.items():
            if key == "type":
                if not isinstance(value, _SCALARS):
                    return None
                keys.append(("type", value))
            elif key == "id" and type(value) is str:
                values.append(value)
                keys.append(("id", value != ""))
            elif key == "function" and type(value) is dict and _function(value, values, keys):
                continue
            else:
                return None
        out.append(tuple(keys))
    return ("calls", tuple(out))


def _function(fn: dict[str, Any], values: list[Any], keys: list[Any]) -> bool:
    """A call's function as chat_messages builds it: arguments (a dict) and name, in order."""
    if fn.keys() != {"arguments", "name"} or type(fn["name"]) is not str:
        return False
    if type(fn["arguments"]) is not dict:
        return False
    order = []
    for key, value in fn.items():
        values.append(value)
        order.append((key, bool(value)))
    keys.append(("function", tuple(order)))
    return True


def probe_conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every non-empty value replaced by its slot's probe, in
    ``conversation_shape``'s order (empty ones stay as they are, and still take a slot)."""
    slot = 0

    def probe(value: Any) -> Any:
        nonlocal slot
        slot += 1
        if not value:
            return value
        return ArgumentsProbe(slot - 1) if type(value) is dict else TextProbe(marker(slot - 1))

    out: list[dict[str, Any]] = []
    for m in messages:
        copy: dict[str, Any] = {}
        for key, value in m.items():
            if key == "role":
                copy[key] = value
            elif key == "content" and type(value) is list:
                copy[key] = [{"type": "text", "text": probe(p["text"])} for p in value]
            elif key == "tool_calls":
                copy[key] = [_probe_call(call, probe) for call in value]
            else:  # content, name, tool_call_id
                copy[key] = probe(value)
        out.append(copy)
    return out


def _probe_call(call: dict[str, Any], probe: Any) -> dict[str, Any]:
    copy: dict[str, Any] = {}
    for key, value in call.items():
        if key == "id":
            copy[key] = probe(value)
        elif key == "function":
            copy[key] = {k: probe(v) for k, v in value.items()}
        else:
            copy[key] = value
    return copy
