"""Chats spliced into their shape's skeleton render exactly what the template renders."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.chat_skeleton import ChatSkeletons
from routing.chat_template import ChatTemplate, ChatTemplateError
from tests.tiny_model import CHATML

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
# Llama 3's way: the system message trimmed and taken out, a date line from strftime_now,
# every content trimmed.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
# Qwen3's way: an assistant's reasoning cut at </think> (reads the content).
THINKING = (
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEXTS = st.text(alphabet=st.sampled_from(list('ab {}%"\\\n\t</>think\ue000\ue0010')), max_size=30)


def chat(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"role": r, "content": c} for r, c in pairs]


def both(skeletons: ChatSkeletons, template: ChatTemplate, messages: Any, **kw: Any) -> str:
    fast = skeletons.render(messages, **kw)
    assert fast == template.render(messages, **kw)
    return fast


@settings(max_examples=150, deadline=None)
@given(system=TEXTS, user=TEXTS, answer=TEXTS, again=TEXTS)
def test_chatml_chats_come_from_one_skeleton_per_shape(
    system: str, user: str, answer: str, again: str
) -> None:
    template = ChatTemplate(CHATML, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    for _ in range(2):
        both(skeletons, template, chat(("system", system), ("user", user)))
        both(skeletons, template, chat(("user", user), ("assistant", answer), ("user", again)))
    assert skeletons.skeleton_renders == 2 and skeletons.ineligible == 0
    assert not skeletons.off


# Llama 3.2's way: content as a list of parts (vLLM's "openai" content format), each trimmed.
PARTS = (
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>' }}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{{- part['text'] | trim }}{%- endif %}{%- endfor %}{{- '<|eot|>' }}{%- endfor %}"
)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(TEXTS, min_size=1, max_size=3), answer=TEXTS)
def test_text_parts_are_slots_of_their_own(parts: list[str], answer: str) -> None:
    template = ChatTemplate(PARTS, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": p} for p in parts]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    for _ in range(2):
        both(skeletons, template, messages)
    assert skeletons.skeleton_renders == 1 and skeletons.learned == 1


# Hermes's way: the tools as JSON, calls by name with their arguments as JSON, a tool's
# result as a JSON string.
TOOLS = (
    "{%- if tools %}<tools>{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools>"
    "{%- endif %}{%- for message in messages %}<|{{ message.role }}|>"
    '{%- if message.role == \'tool\' %}{"name": "{{ message.name }}", "content": '
    "{{ message.content | tojson }}}{%- else %}{{ message.content }}{%- endif %}"
    '{%- for call in message.tool_calls or [] %}<call id={{ call.id }}>{"name": '
    '"{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "</call>{%- endfor %}{%- endfor %}"
)
# Qwen3-coder's way: each argument as its own XML element (reads the arguments).
ARGUMENT_ITEMS = (
    "{%- for message in messages %}{{ message.content }}{%- for call in message.tool_calls or [] %}"
    "{%- for k, v in call.function.arguments | items %}<{{ k }}>{{ v }}</{{ k }}>{%- endfor %}"
    "{%- endfor %}{%- endfor %}"
)
ARGS = st.dictionaries(TEXTS, st.integers() | TEXTS | st.lists(TEXTS, max_size=2), max_size=3)


def agent(call_id: str, name: str, args: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """A turn as routing/chat_messages.py rebuilds it: a call, its result, the next ask."""
    call = {"id": call_id, "function": {"arguments": args, "name": name}, "type": "function"}
    return [
        {"role": "user", "content": "what now?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result, "tool_call_id": call_id, "name": name},
        {"role": "user", "content": "and then?"},
    ]


@settings(max_examples=150, deadline=None)
@given(call_id=TEXTS, name=TEXTS, args=ARGS, result=TEXTS)
def test_tool_calls_and_results_are_slots_too(
    call_id: str, name: str, args: dict[str, Any], result: str
) -> None:
    template = ChatTemplate(TOOLS, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"a": "{}"}}}]
    # A first request of the same shape (the same values empty), then this one, spliced.
    twin = agent(
        "c0" * bool(call_id), "f" * bool(name), {"a": 1} if args else {}, "ok" * bool(result)
    )
    for messages in (twin, agent(call_id, name, args, result)):
        both(skeletons, template, messages, tools=tools)
    both(skeletons, template, agent(call_id, name, args, result), tools=tools[:0])
    assert skeletons.ineligible == 0 and skeletons.skeleton_renders >= 1


def test_the_tools_offered_are_part_of_the_shape_and_read_arguments_are_not_spliced() -> None:
    template = ChatTemplate(TOOLS, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    one = [{"type": "function", "function": {"name": "f"}}]
    two = [*one, {"type": "function", "function": {"name": "g"}}]
    for tools in (one, two, one):
        assert "g" in both(skeletons, template, agent("c", "f", {}, "r"), tools=tools) or (
            tools is one
        )
    assert skeletons.learned == 2 and skeletons.skeleton_renders == 1
    items = ChatTemplate(ARGUMENT_ITEMS, SPECIAL)
    reads = ChatSkeletons(items, verify_every=0)
    for _ in range(2):
        assert "<city>Rome</city>" in both(reads, items, agent("c", "f", {"city": "Rome"}, ""))
    assert reads.ineligible == 1 and reads.skeleton_renders == 0


@settings(max_examples=100, deadline=None)
@given(system=TEXTS, user=TEXTS)
def test_trimmed_contents_and_the_date_line_are_replayed(system: str, user: str) -> None:
    day = [datetime(2026, 11, 29, 23, 59)]
    template = ChatTemplate(LLAMA3, SPECIAL, now=lambda: day[0])
    skeletons = ChatSkeletons(template, verify_every=0)
    messages = chat(("system", system), ("user", user))
    first = both(skeletons, template, messages)
    assert both(skeletons, template, messages) == first
    if skeletons.ineligible == 0:  # a trimmed content tested for truth is read; else spliced
        assert skeletons.skeleton_renders == 1
    day[0] = datetime(2026, 11, 30, 0, 1)  # the date line moves: the shape is learned again
    assert "30 Nov 2026" in both(skeletons, template, messages)


def test_a_template_that_reads_contents_renders_those_shapes_itself() -> None:
    template = ChatTemplate(THINKING, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    with_answer = chat(("user", "hi"), ("assistant", "hmm</think>\n\nhello"), ("user", "and?"))
    for _ in range(3):
        assert "hmm" not in both(skeletons, template, with_answer)
        both(skeletons, template, chat(("user", "hi")))
    assert skeletons.ineligible == 1  # the shape with an assistant turn: its content is read
    assert skeletons.skeleton_renders == 2  # the user-only shape is spliced


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages | tojson(indent=2) }}",  # JSON with options: not recorded
        "{% for m in messages %}{{ (m.content ~ '!') | tojson }}{% endfor %}",  # combined first
        "{% for m in messages %}{{ (m.content ~ '\\n') | trim }}{% endfor %}",  # ~ then trim
        "{% for m in messages %}{% if m.content | trim %}{{ m.content }}{% endif %}{% endfor %}",
        "{% for m in messages %}{{ m.content | length }}{{ m.content[:3] }}{% endfor %}",
        "{% for m in messages %}{{ m.content.replace('a', 'b') }}{% endfor %}",
        "{% for m in messages %}{{ [m.content, ' '] | join | trim }}{% endfor %}",
        "{% for m in messages %}{{ '%s ' | format(m.content) | trim }}{% endfor %}",
        "{% for m in messages %}{{ ('%s ' % m.content) | trim }}{% endfor %}",
        "{% for m in messages %}{% if m.content == 'x' %}X{% endif %}{{ m.content }}{% endfor %}",
    ],
)
def test_every_way_of_reading_a_content_keeps_the_full_render(source: str) -> None:
    template = ChatTemplate(source, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    for content in ("x", ' "a"\n ', "   "):
        both(skeletons, template, chat(("user", content)))
    assert skeletons.skeleton_renders == 0 and skeletons.ineligible == 1


def test_a_skeleton_the_template_disagrees_with_is_caught_and_turns_them_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # | safe copies the probe into a plain string that trim then works on unseen: the check
    # against the full render is what catches it.
    source = "{% for m in messages %}[{{ m.content | safe | trim }}]{% endfor %}"
    template = ChatTemplate(source, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=1)
    assert skeletons.render(chat(("user", "x"))) == "[x]"  # learned, checked: agrees
    secret = "  y: my account number  "
    assert skeletons.render(chat(("user", secret))) == f"[{secret.strip()}]"  # the full render
    assert "differs from the template's at character 1" in caplog.text
    assert "account" not in caplog.text  # where, never the prompt itself
    assert skeletons.off and skeletons.checks == 2
    assert skeletons.render(chat(("user", "  z "))) == "[z]"  # from now on: the template


def test_other_conversations_and_options_go_to_the_template() -> None:
    template = ChatTemplate(CHATML, SPECIAL)
    skeletons = ChatSkeletons(template)
    reasoning = [{"role": "assistant", "content": "hi", "reasoning": "because"}]
    parts = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for messages, kw in (
        (reasoning, {}),
        (parts, {}),
        (chat(("user", "hi")), {"tools": [{"type": "function", "f": {1, 2}}]}),  # not JSON
        (chat(("user", "hi")), {"documents": [{"text": "d"}]}),
        (chat(("user", "hi")), {"add_generation_prompt": False, "continue_final_message": True}),
        (chat(("user", "hi")), {"unused": {"a": 1}}),
    ):
        both(skeletons, template, messages, **kw)
    assert skeletons.learned == 0 and skeletons.skeleton_renders == 0


def test_a_refused_conversation_raises_as_the_template_does_and_is_not_learned() -> None:
    source = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    skeletons = ChatSkeletons(ChatTemplate(source, SPECIAL))
    for _ in range(2):
        with pytest.raises(ChatTemplateError, match="user first"):
            skeletons.render(chat(("assistant", "x")))
    assert skeletons.learned == 0 and skeletons.ineligible == 0


def test_shapes_are_bounded_and_kwargs_are_part_of_the_shape() -> None:
    source = "{% if loud %}!{% endif %}{% for m in messages %}{{ m.role }}:{{ m.content }};"
    source += "{% endfor %}"
    template = ChatTemplate(source, SPECIAL)
    skeletons = ChatSkeletons(template, max_shapes=3, verify_every=0)
    for n in range(1, 6):
        both(skeletons, template, chat(*[("user", str(i)) for i in range(n)]))
    assert skeletons.learned == 5
    assert both(skeletons, template, chat(("user", "a")), loud=True) == "!user:a;"
    assert both(skeletons, template, chat(("user", "a")), loud=False) == "user:a;"
    assert skeletons.learned == 7  # one skeleton per kwarg value; the oldest shapes let go
    both(skeletons, template, chat(("user", "a")))
    assert skeletons.learned == 8


def test_a_template_that_reads_most_conversations_turns_skeletons_off() -> None:
    template = ChatTemplate(THINKING, SPECIAL)
    skeletons = ChatSkeletons(template, verify_every=0)
    for n in range(1, 40):  # 39 shapes, each with an assistant turn: all read
        both(skeletons, template, chat(*[("assistant", f"a{i}</think>b") for i in range(n)]))
    assert skeletons.off and skeletons.ineligible == 32
    assert skeletons.stats()["off_reason"] == "the template reads most conversations' texts"


def test_a_template_without_a_clock_is_probed_without_one() -> None:
    source = (
        "{% if strftime_now is defined %}{{ strftime_now('%Y') }}{% else %}no clock{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    template = ChatTemplate(source, SPECIAL)  # no now=: strftime_now is undefined
    skeletons = ChatSkeletons(template, verify_every=0)
    for user in ("a", "b"):
        assert both(skeletons, template, chat(("user", user))) == f"no clock{user}"
    assert skeletons.skeleton_renders == 1


@settings(max_examples=100, deadline=None)
@given(user=TEXTS, other=TEXTS)
def test_json_of_messages_is_spliced_as_json_strings(user: str, other: str) -> None:
    # Llama 3.1's tool results: {"output": content} | tojson; here the whole conversation.
    template = ChatTemplate(
        "{{ messages | tojson }}{{ {'output': messages[0].content} | tojson }}", SPECIAL
    )
    skeletons = ChatSkeletons(template, verify_every=0)
    both(skeletons, template, chat(("user", "x" * bool(user))))
    both(skeletons, template, chat(("user", user)))
    assert skeletons.ineligible == 0 and skeletons.skeleton_renders == 1
