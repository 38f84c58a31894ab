"""The emulator reads prompts with the gateway's own encoder: same model dir, same token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.model_files import load_prompt_encoder
from replay.emulator.config import EmulatorConfig
from replay.emulator.openai_api import RequestError, parse_request
from replay.emulator.state import build_state
from routing.prompt_encoder import CHAT_PATH
from routing.tokenizer import unpack_token_ids
from tests.tiny_model import write_model_dir

MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. " * 8},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
]


def test_emulator_with_a_model_dir_tokenizes_chat_as_the_gateway(tmp_path: Path) -> None:
    root = write_model_dir(tmp_path / "m")
    state = build_state(EmulatorConfig(model_dir=str(root)))
    assert state.prompt_encoder.exact
    body = {"messages": MESSAGES}
    req = parse_request(body, chat=True, encoder=state.prompt_encoder, default_max_tokens=16)
    gateway = load_prompt_encoder(root).encode(CHAT_PATH, body)
    assert req.token_ids == unpack_token_ids(gateway.packed)
    assert req.token_ids[:2] == [0, 2]  # <s><|im_start|>: the template's rendering
    text = parse_request(
        {"prompt": "hi there"}, chat=False, encoder=state.prompt_encoder, default_max_tokens=16
    )
    assert text.token_ids[0] == 0  # the tokenizer's BOS, as vLLM's completions add it


def test_emulator_default_stays_approximate_and_errors_stay_400() -> None:
    state = build_state(EmulatorConfig())
    assert not state.prompt_encoder.exact
    with pytest.raises(RequestError) as err:
        parse_request(
            {"messages": [{"role": "user", "content": 3}]},
            chat=True,
            encoder=state.prompt_encoder,
            default_max_tokens=16,
        )
    assert err.value.status == 400 and err.value.param == "messages[0].content"
