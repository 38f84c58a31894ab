"""Chat templates render as Hugging Face's apply_chat_template (and so vLLM) renders them."""

from __future__ import annotations

from datetime import datetime

import pytest

from routing.chat_template import ChatTemplate, ChatTemplateError
from tests.tiny_model import CHATML

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_chatml_renders_with_bos_and_generation_prompt() -> None:
    t = ChatTemplate(CHATML, SPECIAL)
    assert t.render(CHAT) == (
        "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not t.render(CHAT, add_generation_prompt=False).endswith("assistant\n")


def test_trim_blocks_and_lstrip_blocks_as_transformers_sets_them() -> None:
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indent before one.
    source = (
        "{% for m in messages %}\n    {% if true %}\n[{{ m['content'] }}]\n"
        "    {% endif %}\n{% endfor %}"
    )
    assert ChatTemplate(source, {}).render(CHAT) == "[be brief]\n[hi]\n"


def test_tojson_does_not_escape_html_nor_unicode_and_takes_options() -> None:
    t = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}", {})
    tools = [{"name": "<b>é</b>", "x": 1}]
    assert t.render(CHAT, tools=tools) == (
        '[{"name": "<b>é</b>", "x": 1}]|{\n  "name": "<b>é</b>",\n  "x": 1\n}'
    )


def test_raise_exception_becomes_a_template_error_with_its_message() -> None:
    t = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}", {}
    )
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render(CHAT)


def test_strftime_now_reads_the_clock_handed_in() -> None:
    source = "{{ strftime_now('%d %b %Y') }}"
    fixed = ChatTemplate(source, {}, now=lambda: datetime(2024, 7, 26, 12, 0))
    assert fixed.render(CHAT) == "26 Jul 2024"
    with pytest.raises(ChatTemplateError):  # no clock: the pure core never reads one itself
        ChatTemplate(source, {}).render(CHAT)


def test_syntax_errors_name_the_line() -> None:
    with pytest.raises(ChatTemplateError, match="line 2"):
        ChatTemplate("ok\n{% for m in messages %}", {})


def test_the_sandbox_refuses_unsafe_attribute_access() -> None:
    t = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(ChatTemplateError):
        t.render(CHAT)


def test_generation_blocks_and_loop_controls_render() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}<{{ m['content'] }}>{% endgeneration %}{% endfor %}"
    )
    assert ChatTemplate(source, {}).render(CHAT) == "<be brief>"


def test_extra_keywords_and_special_tokens_are_template_variables() -> None:
    t = ChatTemplate("{{ bos_token }}{{ eos_token }}{{ enable_thinking }}", SPECIAL)
    assert t.render(CHAT, enable_thinking=False) == "<s></s>False"
    assert t.variables == {"bos_token", "eos_token", "enable_thinking"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (CHATML, "string"),
        (
            "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages %}{% for m in msgs %}{% for p in m['content'] | list %}x"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for x in m['tool_calls'] %}x{% endfor %}{% endfor %}",
            "string",
        ),
    ],
)
def test_content_format_detection_as_vllm(source: str, expected: str) -> None:
    assert ChatTemplate(source, {}).content_format == expected


def test_developer_role_support_is_read_from_the_source() -> None:
    assert not ChatTemplate(CHATML, {}).supports_developer_role
    assert ChatTemplate("{% if m == 'developer' %}{% endif %}", {}).supports_developer_role


def test_continue_final_message_cuts_after_the_final_message() -> None:
    t = ChatTemplate(CHATML, SPECIAL)
    chat = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    text = t.render(chat, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(ChatTemplateError, match="not compatible"):
        t.render(chat, add_generation_prompt=True, continue_final_message=True)
