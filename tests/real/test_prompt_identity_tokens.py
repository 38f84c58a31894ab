"""kvgate's prompt token ids equal a real vLLM's own, for chat and completion requests.

Two witnesses on the engine side: ``POST /tokenize`` (same ``messages`` / ``prompt`` and the
same add_generation_prompt / add_special_tokens defaults as the serving endpoints) and the
``prompt_token_ids`` a real ``/v1/chat/completions`` or ``/v1/completions`` returns with
``return_token_ids`` (what the engine actually prefilled and cached).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from backends.model_files import load_prompt_encoder
from routing.prompt_encoder import CHAT_PATH, EnginePromptEncoder
from routing.tokenizer import unpack_token_ids
from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, start_vllm, stop_engine

pytestmark = pytest.mark.real_engine

COMPLETIONS = "/v1/completions"
SYSTEM = "You are a careful assistant for the kvgate gateway tests. Answer briefly. " * 12

CHATS: dict[str, dict[str, Any]] = {
    "system_and_user": {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi!"}]
    },
    "multi_part_content": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "first part"},
                    {"type": "text", "text": "  second part, with spaces\n"},
                ],
            },
        ]
    },
    "tool_round_trip": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "22 °C, sunny"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
        # vLLM refuses "auto" (the default with tools) without a tool parser; "none" still
        # renders the tools.
        "tool_choice": "none",
    },
    "no_generation_prompt": {
        "messages": [{"role": "user", "content": "ünïcödé 数字 <|im_end|> inside text"}],
        "add_generation_prompt": False,
    },
    "developer_role": {
        "messages": [
            {"role": "system", "content": "a"},
            {"role": "user", "content": "b"},
            {"role": "developer", "content": "c"},
        ]
    },
}
# A second template, sent per request (the engine runs with --trust-request-chat-template) and
# loaded by kvgate from a model dir of its own: tools through tojson, a loop over content parts
# (vLLM's "openai" content format), tool calls, strftime_now, whitespace control.
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ strftime_now('%Y-%m-%d') }} tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + message.role) }}
  {%- endif %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% else %}
  {%- for part in message.content %}{% if part.type == 'text' %}[{{ part.text }}]{% endif %}
  {%- endfor %}{% endif %}
  {%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>{{ call.function | tojson }}</tool_call>
  {%- endfor %}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
COMPLETION_PROMPTS: dict[str, dict[str, Any]] = {
    "text": {"prompt": SYSTEM + " Complete this:"},
    "text_without_special_tokens": {"prompt": "plain text", "add_special_tokens": False},
    "token_ids": {"prompt": [5, 6, 7, 8, 9, 10]},
}


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from None


@pytest.fixture(scope="module")
def engine(vllm_install: EngineInstall) -> Iterator[EngineProcess]:
    (port,) = free_ports(1, 18100, 18200)
    proc = start_vllm(port, extra_args=["--trust-request-chat-template"])
    yield proc
    stop_engine(proc)


@pytest.fixture(scope="module")
def encoder(engine: EngineProcess) -> EnginePromptEncoder:
    assert engine.model_dir is not None
    return load_prompt_encoder(engine.model_dir)


@pytest.fixture(scope="module")
def tools_encoder(
    engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory
) -> EnginePromptEncoder:
    assert engine.model_dir is not None
    root = tmp_path_factory.mktemp("tools-model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(engine.model_dir / name, root / name)
    (root / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    encoder = load_prompt_encoder(root)
    assert encoder.template is not None and encoder.template.content_format == "openai"
    return encoder


def kvgate_ids(encoder: EnginePromptEncoder, path: str, body: dict[str, Any]) -> list[int]:
    return unpack_token_ids(encoder.encode(path, body).packed)


def served_prompt_ids(engine: EngineProcess, path: str, body: dict[str, Any]) -> list[int]:
    out = post(
        engine.url + path,
        {**body, "model": engine.model, "max_tokens": 1, "return_token_ids": True},
    )
    ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
    assert ids, f"no prompt_token_ids in {sorted(out)}"
    return list(ids)


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_tokens_equal_the_engines(
    case: str, engine: EngineProcess, encoder: EnginePromptEncoder
) -> None:
    body = CHATS[case]
    ours = kvgate_ids(encoder, CHAT_PATH, body)
    tokenized = post(engine.url + "/tokenize", {**body, "model": engine.model})["tokens"]
    assert ours == tokenized
    assert ours == served_prompt_ids(engine, CHAT_PATH, body)


@pytest.mark.parametrize("case", ["system_and_user", "multi_part_content", "tool_round_trip"])
def test_chat_tokens_equal_the_engines_with_a_tools_template(
    case: str, engine: EngineProcess, tools_encoder: EnginePromptEncoder
) -> None:
    body = CHATS[case]
    ours = kvgate_ids(tools_encoder, CHAT_PATH, body)
    sent = {**body, "chat_template": TOOLS_TEMPLATE}
    tokenized = post(engine.url + "/tokenize", {**sent, "model": engine.model})["tokens"]
    assert ours == tokenized
    assert ours == served_prompt_ids(engine, CHAT_PATH, sent)


@pytest.mark.parametrize("case", sorted(COMPLETION_PROMPTS))
def test_completion_tokens_equal_the_engines(
    case: str, engine: EngineProcess, encoder: EnginePromptEncoder
) -> None:
    body = COMPLETION_PROMPTS[case]
    ours = kvgate_ids(encoder, COMPLETIONS, body)
    if isinstance(body["prompt"], str):
        tokenized = post(engine.url + "/tokenize", {**body, "model": engine.model})["tokens"]
        assert ours == tokenized
    assert ours == served_prompt_ids(engine, COMPLETIONS, body)
