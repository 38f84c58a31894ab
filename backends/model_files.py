"""Load a served model's tokenizer and chat template from its Hugging Face model directory.

What is read, as transformers (and so vLLM) reads it: ``tokenizer.json`` (the ``tokenizers``
library), ``tokenizer_config.json`` (named special tokens such as ``bos_token``, and
``chat_template`` when there is no ``chat_template.jinja``), and ``chat_template.jinja``, which
takes priority. Errors name the file. With no ``routing.model_dir`` the gateway falls back to
the approximate tokenizer and says so once at start-up.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from backends.fast_bpe import stretch_encoder
from backends.tokenizer_file import load_tokenizer
from config.errors import KvgateError
from config.settings import RoutingSettings
from routing.chat_template import ChatTemplate, ChatTemplateError
from routing.prompt_encoder import ApproxPromptEncoder, EnginePromptEncoder, PromptEncoder

log = logging.getLogger("kvgate.model_files")

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip


class ModelFilesError(KvgateError, ValueError):
    """A model directory kvgate cannot use; the message names the file."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The template variables transformers' ``special_tokens_map`` gives: the named special
    tokens, other ``*_token`` keys, and a named ``extra_special_tokens`` table."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if key in _NAMED_SPECIAL or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                out[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            text = _token_text(value)
            if text is not None:
                out[str(key)] = text
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelFilesError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelFilesError(f"{path}: expected a JSON object")
    return data


def _template_sources(root: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], Path]:
    """Named template sources (``"default"``, maybe ``"tool_use"``) and the file they came from."""
    jinja = root / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return {"default": jinja.read_text(encoding="utf-8")}, jinja
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelFilesError(f"cannot read {jinja}: {exc}") from None
    where = root / TOKENIZER_CONFIG_FILE
    raw = config.get("chat_template")
    if raw is None:
        return {}, where
    if isinstance(raw, str):
        return {"default": raw}, where
    if isinstance(raw, list):  # [{"name": ..., "template": ...}]
        named = {
            t["name"]: t["template"]
            for t in raw
            if isinstance(t, Mapping)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
        if len(named) == len(raw):
            return named, where
    raise ModelFilesError(f"{where}: chat_template must be a string or a list of named templates")


def _compile(source: str, special: Mapping[str, str], where: Path, name: str) -> ChatTemplate:
    try:
        return ChatTemplate(source, special, now=datetime.now)
    except ChatTemplateError as exc:
        label = "" if name == "default" else f" ({name!r})"
        raise ModelFilesError(f"{where}: chat template{label} does not compile: {exc}") from None


def _load_tokenizer(path: Path) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - depends on the environment
        raise ModelFilesError(
            "routing.model_dir needs the 'tokenizers' package: pip install 'kvgate[tokenizer]'"
        ) from None
    if not path.is_file():
        raise ModelFilesError(
            f"{path} not found: routing.model_dir must hold the model's fast tokenizer file"
        )
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON / models
        raise ModelFilesError(f"cannot load {path}: {exc}") from None
    # Engines tokenize whole prompts: a truncation or padding saved in the file must not apply.
    tok.no_truncation()
    tok.no_padding()
    return tok


def load_prompt_encoder(
    model_dir: str | Path,
    *,
    segment_cache_bytes: int = 32 << 20,
    tiktoken: bool = True,
    skeletons: bool = True,
) -> EnginePromptEncoder:
    """The engine-exact encoder of the model in ``model_dir`` (``segment_cache_bytes``: the
    bound of its memo of tokenized prompt stretches, 0 = none; ``tiktoken``: run a byte-level
    BPE's stretches on tiktoken where it gives the same ids; ``skeletons``: splice chats into
    their shape's rendering, routing/chat_skeleton.py)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelFilesError(f"model directory not found: {root}")
    tokenizer = _load_tokenizer(root / TOKENIZER_FILE)
    config_path = root / TOKENIZER_CONFIG_FILE
    config = _read_json(config_path) if config_path.is_file() else {}
    special = special_tokens(config)
    sources, where = _template_sources(root, config)
    templates = {name: _compile(src, special, where, name) for name, src in sources.items()}
    default = templates.get("default")
    if default is None and templates:
        raise ModelFilesError(f"{where}: the chat templates have no 'default' one")
    if default is None:
        log.warning("%s has no chat template: chat requests will be refused", root)
    return EnginePromptEncoder(
        tokenizer,
        default,
        tool_template=templates.get("tool_use"),
        segment_cache_bytes=segment_cache_bytes,
        stretches=stretch_encoder(tokenizer) if tiktoken else None,
        skeletons=skeletons,
    )


def make_prompt_encoder(routing: RoutingSettings) -> PromptEncoder:
    """Exact when ``routing.model_dir`` is set; else the approximate tokenizer (said once)."""
    if routing.model_dir:
        encoder = load_prompt_encoder(
            routing.model_dir, tiktoken=routing.tiktoken, skeletons=routing.template_skeletons
        )
        log.info(
            "prompt identity: engine-exact tokenizer and chat template from %s%s",
            routing.model_dir,
            " (text between added tokens on tiktoken)" if encoder.segments.fast else "",
        )
        return encoder
    tokenizer = load_tokenizer(routing.tokenizer_file, routing.chars_per_token)
    log.warning(
        "prompt identity is APPROXIMATE (%r; chat messages joined as plain text): prefix "
        "matches line up with the engine's cache only roughly. Set routing.model_dir to the "
        "served model's directory for the engine's own tokens.",
        tokenizer,
    )
    return ApproxPromptEncoder(tokenizer)
