"""CPU per request of rendering chat prompts: the model's chat template vs its skeletons.

Two workloads, each ``--requests`` distinct conversations of one shape (what a skeleton is
learned once for): ``plain`` (a system prompt and a user turn) and ``agent`` (a user turn, an
assistant tool call with JSON arguments, the tool's result with its id and name, the next user
turn; six tools offered). Each conversation is rebuilt as vLLM hands it to the template
(routing/chat_messages.py), then rendered by ``ChatTemplate.render`` and by
``ChatSkeletons.render`` (its checks every 64th request included); the best of ``--reps``
passes, process CPU clock. The skeleton's output is compared with the template's on every
request, so a number is only reported for renders that agree.

    python -m bench.chat_render                          # the tiny test model's template
    python -m bench.chat_render --template path/to/chat_template.jinja [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from routing.chat_messages import engine_conversation, engine_tools
from routing.chat_skeleton import ChatSkeletons
from routing.chat_template import ChatTemplate, ChatTemplateError

DEFAULT_TEMPLATE = Path.home() / ".cache/kvgate-engines/vllm-0.32.0/tiny-model/chat_template.jinja"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Does thing number {i} for the user, carefully.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    }
    for i in range(6)
]


def plain(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful assistant for a retail bank."},
        {"role": "user", "content": f"Request {i}: summarise the account activity of {i * 7919}."},
    ]


def agent(i: int) -> list[dict[str, Any]]:
    call = {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "tool_1", "arguments": json.dumps({"city": f"Paris {i}"})},
    }
    return [
        {"role": "user", "content": f"Weather in Paris? ({i})"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "name": "tool_1", "content": f"{i} C"},
        {"role": "user", "content": f"And in Rome? ({i})"},
    ]


def _cpu_us(render: Callable[..., str], tools: Any, conversations: list[Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for conversation in conversations:
            render(conversation, tools=tools)
        best = min(best, (time.process_time() - t0) / len(conversations) * 1e6)
    return round(best, 2)


def measure(template: ChatTemplate, requests: int, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, build, tools in (("plain", plain, None), ("agent", agent, engine_tools(TOOLS))):
        conversations = [
            engine_conversation(
                build(i), template.content_format, developer_role=template.supports_developer_role
            )
            for i in range(requests)
        ]
        skeletons = ChatSkeletons(template)
        try:
            for c in conversations:  # learns the shape; every render checked once here
                if skeletons.render(c, tools=tools) != template.render(c, tools=tools):
                    raise SystemExit(f"{name}: a skeleton disagreed with the template")
        except ChatTemplateError as exc:
            out[name] = {"error": f"the template refuses this workload: {exc}"}
            continue
        out[name] = {
            "template_us": _cpu_us(template.render, tools, conversations, reps),
            "skeleton_us": _cpu_us(skeletons.render, tools, conversations, reps),
            "skeletons": skeletons.stats(),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE, help="a .jinja file")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the result here")
    a = p.parse_args(argv)
    if not a.template.is_file():
        print(f"{a.template}: no such template (bash engines/vllm_cpu.sh install makes the "
              "tiny model's, or pass --template)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        template = ChatTemplate(a.template.read_text(), SPECIAL)
    except ChatTemplateError as exc:
        print(f"{a.template}: {exc}", file=sys.stderr)
        return 2
    result = {"template": str(a.template), "requests": a.requests, "reps": a.reps}
    result["workloads"] = measure(template, max(a.requests, 1), max(a.reps, 1))
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
