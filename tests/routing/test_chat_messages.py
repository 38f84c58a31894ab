"""Messages and tools are rebuilt as vLLM 0.32 rebuilds them before rendering."""

from __future__ import annotations

import pytest

from routing.chat_messages import engine_conversation, engine_tools
from routing.prompt import PromptError


def test_string_format_joins_text_parts_with_newlines_and_skips_media() -> None:
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one"},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                {"type": "text", "text": "two"},
                "three",
            ],
        },
        {"role": "assistant", "content": None},
    ]
    conv = engine_conversation(msgs, "string", developer_role=False)
    assert conv == [
        {"role": "user", "content": "one\ntwo\nthree"},
        {"role": "assistant", "content": ""},
    ]


def test_openai_format_keeps_text_parts_as_a_list() -> None:
    conv = engine_conversation([{"role": "user", "content": "hi"}], "openai", developer_role=False)
    assert conv == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_tool_messages_are_flattened_for_every_template() -> None:
    msg = {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "22C"}]}
    conv = engine_conversation([msg], "openai", developer_role=False)
    assert conv == [{"role": "tool", "content": "22C", "tool_call_id": "c1"}]


def test_assistant_tool_call_arguments_become_objects() -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}},
    ]
    (conv,) = engine_conversation(
        [{"role": "assistant", "content": None, "tool_calls": calls}],
        "string",
        developer_role=False,
    )
    assert [c["function"]["arguments"] for c in conv["tool_calls"]] == [{"x": 1}, {}, {}]
    (empty,) = engine_conversation(
        [{"role": "assistant", "content": "x", "tool_calls": []}], "string", developer_role=False
    )
    assert "tool_calls" not in empty


def test_developer_becomes_system_and_systems_merge_when_the_template_lacks_it() -> None:
    msgs = [
        {"role": "system", "content": "a"},
        {"role": "user", "content": "q"},
        {"role": "developer", "content": "b"},
    ]
    conv = engine_conversation(msgs, "string", developer_role=False)
    assert conv == [{"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "q"}]
    kept = engine_conversation(msgs, "string", developer_role=True)
    assert kept[2]["role"] == "developer"


def test_claude_code_billing_header_is_dropped_from_system_text() -> None:
    text = "x-anthropic-billing-header: cch=123\nYou are helpful."
    (conv,) = engine_conversation(
        [{"role": "system", "content": text}], "string", developer_role=False
    )
    assert conv["content"] == "You are helpful."


def test_tools_are_dumped_like_vllms_request_model() -> None:
    tools = [{"type": "function", "function": {"name": "f", "extra": 1}}]
    assert engine_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}}
    ]
    assert engine_tools(None) is None


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        ([1], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ],
)
def test_bad_messages_name_the_field(messages: object, param: str) -> None:
    with pytest.raises(PromptError) as err:
        engine_conversation(messages, "string", developer_role=False)
    assert err.value.param == param


def test_bad_tools_name_the_field() -> None:
    with pytest.raises(PromptError) as err:
        engine_tools([{"type": "function", "function": {}}])
    assert err.value.param == "tools[0]"


def test_tool_calls_take_the_key_order_vllms_validation_gives_them() -> None:
    call = {"type": "function", "extra": 3, "function": {"name": "f", "arguments": "{}"}, "id": "c"}
    (conv,) = engine_conversation(
        [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "string",
        developer_role=False,
    )
    (out,) = conv["tool_calls"]
    assert list(out) == ["id", "function", "type", "extra"]
    assert list(out["function"]) == ["arguments", "name"]
