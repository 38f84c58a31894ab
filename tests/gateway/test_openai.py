"""Parsing a completion request into the core's RequestInfo, and the errors it names."""

from __future__ import annotations

import json

import pytest

from config.settings import Settings
from gateway.openai import CHAT, COMPLETIONS, BadRequest, ParsedRequest, parse_request
from routing.hashing import BlockHasher
from routing.prompt import chat_prompt_text
from routing.prompt_encoder import ApproxPromptEncoder
from routing.tokenizer import ApproxTokenizer, Tokenizer

SETTINGS = Settings()
HASHER = BlockHasher(16)
TOKENIZER = ApproxTokenizer(4.0)


def parse(
    body: object,
    path: str = COMPLETIONS,
    headers: dict[str, str] | None = None,
    tokenizer: Tokenizer = TOKENIZER,
) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request(
        path,
        raw,
        headers or {},
        "rid-1",
        5.0,
        settings=SETTINGS,
        encoder=ApproxPromptEncoder(tokenizer),
        hasher=HASHER,
    )


class ListTokenizer:
    """A tokenizer with ``encode`` only (no ``pack`` fast path), as a FileTokenizer."""

    def encode(self, text: str) -> list[int]:
        return TOKENIZER.encode(text)


@pytest.mark.parametrize("text", ["hello world " * 40, "héllo wörld " * 40, "x" * 63])
def test_text_prompt_hashes_its_tokens_with_or_without_the_fast_path(text: str) -> None:
    tokens = TOKENIZER.encode(text)
    for tok in (TOKENIZER, ListTokenizer()):
        info = parse({"prompt": text, "max_tokens": 7}, tokenizer=tok).info
        assert info.prompt_tokens == len(tokens)
        assert info.block_hashes == HASHER.hash_tokens(tokens)
        assert info.max_tokens == 7 and info.arrival_s == 5.0 and info.request_id == "rid-1"


def test_chat_prompt_is_the_rendered_messages() -> None:
    messages = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hi"}]
    parsed = parse({"messages": messages, "stream": True}, path=CHAT)
    tokens = TOKENIZER.encode(chat_prompt_text(messages))
    assert parsed.stream is True
    assert parsed.info.block_hashes == HASHER.hash_tokens(tokens)
    assert parsed.info.output_key == parsed.info.block_hashes[0]
    assert parsed.info.max_tokens == SETTINGS.predictors.default_output_tokens


def test_token_id_prompts_and_a_batch_of_one() -> None:
    ids = list(range(40))
    for prompt in (ids, [ids]):
        info = parse({"prompt": prompt}).info
        assert info.prompt_tokens == 40
        assert info.block_hashes == HASHER.hash_tokens(ids) and len(info.block_hashes) == 2


def test_shared_text_prefix_shares_block_hashes() -> None:
    system = "You are a careful assistant. " * 20
    a = parse({"prompt": system + "first question"}).info.block_hashes
    b = parse({"prompt": system + "another one entirely"}).info.block_hashes
    shared = len(system) // 64  # 16 tokens x 4 characters per block
    assert a[:shared] == b[:shared] and len(a) >= shared


def test_priority_and_slo_headers() -> None:
    info = parse(
        {"prompt": "hi"}, headers={"x-kvgate-priority": "high", "x-slo-ttft-ms": "250"}
    ).info
    assert info.priority == "high" and info.slo_ttft_s == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("body", "path", "headers", "param", "status"),
    [
        (b"{not json", COMPLETIONS, {}, None, 400),
        (b"[1, 2]", COMPLETIONS, {}, None, 400),
        ({"prompt": ""}, COMPLETIONS, {}, "prompt", 400),
        ({"prompt": 7}, COMPLETIONS, {}, "prompt", 400),
        ({"prompt": ["a", "b"]}, COMPLETIONS, {}, "prompt", 400),
        ({"prompt": [1, 2**32]}, COMPLETIONS, {}, "prompt", 400),
        ({"prompt": "hi", "stream": "yes"}, COMPLETIONS, {}, "stream", 400),
        ({"prompt": "hi", "max_tokens": 0}, COMPLETIONS, {}, "max_tokens", 400),
        ({"messages": "hi"}, CHAT, {}, "messages", 400),
        ({"prompt": "hi"}, COMPLETIONS, {"x-kvgate-priority": "vip"}, "x-kvgate-priority", 400),
        ({"prompt": "hi"}, COMPLETIONS, {"x-slo-tbt-ms": "-1"}, "x-slo-tbt-ms", 400),
    ],
)
def test_bad_requests_name_the_parameter(body, path, headers, param, status) -> None:
    with pytest.raises(BadRequest) as err:
        parse(body, path=path, headers=headers)
    assert err.value.param == param and err.value.status == status and err.value.message


def test_exact_encoder_hashes_the_engines_own_tokens() -> None:
    from routing.chat_template import ChatTemplate
    from routing.prompt_encoder import EnginePromptEncoder
    from tests.tiny_model import CHATML, load_tokenizer

    tok = load_tokenizer()
    encoder = EnginePromptEncoder(tok, ChatTemplate(CHATML, {"bos_token": "<s>"}))
    system = "You are a careful assistant for the kvgate gateway tests. " * 10
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    raw = json.dumps({"messages": messages}).encode()
    info = parse_request(
        CHAT, raw, {}, "r", 0.0, settings=SETTINGS, encoder=encoder, hasher=HASHER
    ).info
    text = f"<s><|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids
    assert info.prompt_tokens == len(ids) and info.block_hashes == HASHER.hash_tokens(ids)
    salted = json.dumps({"messages": messages, "cache_salt": "tenant-a"}).encode()
    info_salted = parse_request(
        CHAT, salted, {}, "r", 0.0, settings=SETTINGS, encoder=encoder, hasher=HASHER
    ).info
    # A salted prompt never shares blocks with an unsalted one (vLLM keys salt into block 0).
    assert info_salted.prompt_tokens == info.prompt_tokens
    assert not set(info_salted.block_hashes) & set(info.block_hashes)


def test_exact_encoder_errors_are_bad_requests_naming_the_parameter() -> None:
    from routing.chat_template import ChatTemplate
    from routing.prompt_encoder import EnginePromptEncoder
    from tests.tiny_model import load_tokenizer

    encoder = EnginePromptEncoder(load_tokenizer(), ChatTemplate("{{ raise_exception('no') }}", {}))
    body = json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode()
    with pytest.raises(BadRequest) as err:
        parse_request(CHAT, body, {}, "r", 0.0, settings=SETTINGS, encoder=encoder, hasher=HASHER)
    assert err.value.param == "messages" and "no" in err.value.message
