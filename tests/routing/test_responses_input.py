"""A Responses body as the chat body its engine renders (vLLM's construct_input_messages)."""

from __future__ import annotations

import pytest

from routing.prompt import PromptError
from routing.responses_input import responses_chat_body


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    body = {"model": "m", "instructions": "Be terse.", "input": "Hi", "max_output_tokens": 7}
    chat = responses_chat_body({**body, "stream": True, "cache_salt": "s"})
    assert chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    assert chat["max_tokens"] == 7 and chat["stream"] is True and chat["cache_salt"] == "s"
    # vLLM 0.32 tokenizes a Responses prompt with special tokens on (its chat path does not)
    assert chat["add_special_tokens"] is True and "continue_final_message" not in chat
    assert "tools" not in chat
    assert responses_chat_body({"input": "Hi", "instructions": ""})["messages"] == [
        {"role": "user", "content": "Hi"}
    ]


def test_items_become_messages_and_calls_merge_into_the_assistant_turn() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a":2}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"b":2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "reasoning", "id": "r1", "summary": []},  # not shown to the template
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 4."}]},
        {"role": "user", "content": "thanks"},
    ]
    tools = [
        {"type": "function", "name": "add", "parameters": {"type": "object"}},
        {"type": "web_search_preview"},
    ]
    chat = responses_chat_body({"input": items, "tools": tools})
    user, calls, output, answer, thanks = chat["messages"]
    assert user == {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]}
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]
    assert calls["role"] == "assistant" and "content" not in calls
    assert output == {"role": "tool", "content": "4", "tool_call_id": "c1"}
    assert answer["role"] == "assistant" and thanks == {"role": "user", "content": "thanks"}
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    ]


def test_an_assistant_text_after_its_calls_joins_that_turn() -> None:
    items = [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ]
    _, turn = responses_chat_body({"input": items})["messages"]
    assert turn["content"] == "done" and turn["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["text"]}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "x", "instructions": ["no"]}, "instructions"),
    ],
)
def test_what_the_engine_refuses_is_a_prompt_error(body: dict, param: str) -> None:
    with pytest.raises(PromptError) as caught:
        responses_chat_body(body)
    assert caught.value.param == param


def test_a_partial_assistant_turn_is_continued_and_reasoning_effort_passed_on() -> None:
    partial = {"type": "message", "role": "assistant", "status": "incomplete", "content": "one"}
    chat = responses_chat_body(
        {"input": [{"role": "user", "content": "count"}, partial], "reasoning": {"effort": "low"}}
    )
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    assert chat["reasoning_effort"] == "low"
    done = {**partial, "status": "completed"}
    assert "continue_final_message" not in responses_chat_body({"input": [done]})
