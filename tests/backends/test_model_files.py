"""Loading a model directory's tokenizer and chat template; clear errors naming the file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from backends.model_files import (
    ModelFilesError,
    load_prompt_encoder,
    make_prompt_encoder,
    special_tokens,
)
from backends.tokenizer_file import FileTokenizer
from config.errors import ConfigError
from config.loader import settings_from_dict
from config.settings import RoutingSettings
from routing.prompt_encoder import CHAT_PATH, ApproxPromptEncoder, EnginePromptEncoder
from routing.tokenizer import unpack_token_ids
from tests.tiny_model import CHATML, load_tokenizer, write_model_dir

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOK = load_tokenizer()


def chat_ids(encoder: EnginePromptEncoder) -> list[int]:
    return unpack_token_ids(encoder.encode(CHAT_PATH, CHAT).packed)


def test_loads_tokenizer_template_and_special_tokens(tmp_path: Path) -> None:
    enc = load_prompt_encoder(write_model_dir(tmp_path / "m"))
    assert enc.exact and enc.template is not None
    text = "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert chat_ids(enc) == TOK.encode(text, add_special_tokens=False).ids


def test_chat_template_jinja_wins_over_the_config_entry(tmp_path: Path) -> None:
    root = write_model_dir(tmp_path / "m", config={"chat_template": "CONFIG"})
    assert load_prompt_encoder(root).render_chat(CHAT).startswith("<s><|im_start|>")
    only_config = write_model_dir(tmp_path / "c", template=CHATML, template_in_config=True)
    assert load_prompt_encoder(only_config).render_chat(CHAT).startswith("<s><|im_start|>")


def test_named_templates_in_the_config(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": CHATML},
        {"name": "tool_use", "template": "T{{ messages | length }}"},
    ]
    enc = load_prompt_encoder(
        write_model_dir(tmp_path / "m", template=None, config={"chat_template": named})
    )
    assert enc.render_chat(CHAT).startswith("<s>")
    assert (
        enc.render_chat({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]})
        == "T1"
    )


def test_a_model_without_template_serves_completions_only(tmp_path: Path) -> None:
    enc = load_prompt_encoder(write_model_dir(tmp_path / "m", template=None))
    assert enc.template is None
    assert enc.encode("/v1/completions", {"prompt": "hi"}).n_tokens > 0


def test_special_tokens_as_transformers_maps_them() -> None:
    cfg = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
        "pad_token": None,
        "image_token": "<img>",
        "model_max_length": 8192,
        "extra_special_tokens": {"audio_token": "<aud>"},
    }
    assert special_tokens(cfg) == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "image_token": "<img>",
        "audio_token": "<aud>",
    }
    assert special_tokens({"extra_special_tokens": ["<a>", "<b>"]}) == {}


def test_missing_and_broken_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match="model directory not found"):
        load_prompt_encoder(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFilesError, match=r"tokenizer\.json not found"):
        load_prompt_encoder(empty)
    bad_tok = write_model_dir(tmp_path / "t")
    (bad_tok / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFilesError, match=r"cannot load .*tokenizer\.json"):
        load_prompt_encoder(bad_tok)
    bad_cfg = write_model_dir(tmp_path / "c")
    (bad_cfg / "tokenizer_config.json").write_text("[1,")
    with pytest.raises(ModelFilesError, match=r"tokenizer_config\.json"):
        load_prompt_encoder(bad_cfg)
    bad_tpl = write_model_dir(tmp_path / "j", template="{% for m in messages %}")
    with pytest.raises(
        ModelFilesError, match=r"chat_template\.jinja: chat template does not compile"
    ):
        load_prompt_encoder(bad_tpl)
    bad_entry = write_model_dir(tmp_path / "e", template=None, config={"chat_template": 3})
    with pytest.raises(ModelFilesError, match=r"tokenizer_config\.json: chat_template"):
        load_prompt_encoder(bad_entry)


def test_make_prompt_encoder_is_exact_only_with_a_model_dir(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = write_model_dir(tmp_path / "m")
    assert isinstance(
        make_prompt_encoder(RoutingSettings(model_dir=str(root))), EnginePromptEncoder
    )
    with caplog.at_level(logging.WARNING, logger="kvgate.model_files"):
        approx = make_prompt_encoder(RoutingSettings())
    assert isinstance(approx, ApproxPromptEncoder) and not approx.exact
    assert "APPROXIMATE" in caplog.text and "routing.model_dir" in caplog.text
    tok_file = make_prompt_encoder(RoutingSettings(tokenizer_file=str(root / "tokenizer.json")))
    assert isinstance(tok_file, ApproxPromptEncoder)
    assert isinstance(tok_file.tokenizer, FileTokenizer)


def test_config_accepts_model_dir_and_rejects_an_empty_one(tmp_path: Path) -> None:
    s = settings_from_dict({"routing": {"model_dir": str(tmp_path)}})
    assert s.routing.model_dir == str(tmp_path)
    with pytest.raises(ConfigError, match=r"routing\.model_dir"):
        settings_from_dict({"routing": {"model_dir": " "}})


def test_written_config_is_what_transformers_reads(tmp_path: Path) -> None:
    root = write_model_dir(tmp_path / "m")
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<s>" and (root / "chat_template.jinja").read_text() == CHATML
