"""A tiny Hugging Face model directory for tests: a BPE tokenizer trained in well under a
second with the ``tokenizers`` trainer, ChatML special tokens, a BOS-adding post-processor
(as Llama-style models have) and a ChatML chat template that starts with ``bos_token``."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}"
    "</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "You are a careful assistant for the kvgate gateway tests.",
    "the cache holds the prefix of the prompt and the gateway routes it",
    "a block of tokens is hashed with its parent block, chained",
    "Système: réponds en français, s'il te plaît. 数字 123 456 789",
    "def f(x):\n    return x * 2  # code with    spaces\n\n\ttabs",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
]


@lru_cache(maxsize=8)
def tokenizer_json(
    *, bos: bool = True, lstrip_token: bool = False, split: str | None = None, nfc: bool = False
) -> str:
    """A trained byte-level BPE ``tokenizer.json`` (text: callers get fresh objects): GPT-2's
    regex inside the ByteLevel pre-tokenizer, or ``split`` before one without it (Llama 3's
    layout); ``nfc``: an NFC normalizer (Qwen 2's)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    if lstrip_token:  # a token that eats the whitespace before it: splitting is not exact
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    return tok.to_str()


def load_tokenizer(**kwargs: Any) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(**kwargs))


def write_model_dir(
    root: Path,
    *,
    template: str | None = CHATML,
    template_in_config: bool = False,
    config: dict[str, Any] | None = None,
) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja`` unless the
    template goes into the config, or there is none)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tokenizer.json").write_text(tokenizer_json())
    cfg: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", **(config or {})}
    if template is not None and template_in_config:
        cfg["chat_template"] = template
    elif template is not None:
        (root / "chat_template.jinja").write_text(template)
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    return root
