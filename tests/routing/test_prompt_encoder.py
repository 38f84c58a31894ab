"""Request bodies -> prompt token ids: the engine's own (exact) and the approximate fallback."""

from __future__ import annotations

from typing import Any

import pytest

from routing.chat_template import ChatTemplate
from routing.prompt import PromptError, chat_prompt_text
from routing.prompt_encoder import (
    CHAT_PATH,
    ApproxPromptEncoder,
    EnginePromptEncoder,
    PromptTokens,
)
from routing.tokenizer import ApproxTokenizer, pack_token_ids, unpack_token_ids
from tests.tiny_model import CHATML, load_tokenizer

COMPLETIONS = "/v1/completions"
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TOK = load_tokenizer()
SYSTEM = "You are a careful assistant for the kvgate gateway tests. " * 20


def engine(template: str | None = CHATML, **kwargs: Any) -> EnginePromptEncoder:
    chat = ChatTemplate(template, SPECIAL) if template is not None else None
    return EnginePromptEncoder(load_tokenizer(), chat, **kwargs)


def ids(tokens: PromptTokens) -> list[int]:
    assert tokens.n_tokens * 4 == len(tokens.packed)
    return unpack_token_ids(tokens.packed)


def rendered(*turns: tuple[str, str], generation: bool = True) -> str:
    body = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
    return "<s>" + body + ("<|im_start|>assistant\n" if generation else "")


def test_chat_is_the_template_rendering_tokenized_without_adding_specials() -> None:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
    enc = engine()
    assert enc.exact
    got = ids(enc.encode(CHAT_PATH, body))
    text = rendered(("system", SYSTEM), ("user", "hi"))
    assert got == TOK.encode(text, add_special_tokens=False).ids
    assert got[:2] == [0, 2] and got.count(0) == 1  # BOS once: the template's
    # Asked for, special tokens are added on top (vLLM's add_special_tokens): BOS twice.
    doubled = ids(enc.encode(CHAT_PATH, {**body, "add_special_tokens": True}))
    assert doubled == [0, *got]


def test_generation_prompt_and_final_message_options_follow_the_request() -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer"}]
    enc = engine()
    plain = ids(enc.encode(CHAT_PATH, {"messages": msgs, "add_generation_prompt": False}))
    assert (
        plain
        == TOK.encode(rendered(("user", "q"), ("assistant", "The answer"), generation=False)).ids[
            1:
        ]
    )
    cont = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    text = rendered(("user", "q"), generation=False) + "<|im_start|>assistant\nThe answer"
    assert ids(enc.encode(CHAT_PATH, cont)) == TOK.encode(text, add_special_tokens=False).ids


def test_multi_part_content_and_tool_messages_render_as_vllm_flattens_them() -> None:
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "42"},
    ]
    text = (
        "<s><|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>f {"x": 1}</tool_call><|im_end|>\n<|im_start|>tool\n42<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert (
        ids(engine().encode(CHAT_PATH, {"messages": msgs}))
        == TOK.encode(text, add_special_tokens=False).ids
    )


def test_tools_and_template_kwargs_reach_the_template() -> None:
    source = (
        "{% if tools %}{{ tools | tojson }}{% endif %}{{ enable_thinking }}|{{ flavour }}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    enc = engine(source)
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": tools,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"flavour": "mint", "ignored": 1},
    }
    text = enc.render_chat(body)
    assert text == (
        '[{"type": "function", "function": {"name": "f", "description": null, '
        '"parameters": null}}]True|mintx'
    )


def test_a_named_tool_use_template_serves_requests_with_tools() -> None:
    tool_tpl = ChatTemplate("TOOLS{% for m in messages %}{{ m['content'] }}{% endfor %}", {})
    enc = EnginePromptEncoder(TOK, ChatTemplate(CHATML, SPECIAL), tool_template=tool_tpl)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    assert enc.render_chat(body).startswith("<s>")
    body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    assert enc.render_chat(body) == "TOOLSx"
    body["messages"][0]["content"] = "y"  # the same shape: the tool template's skeleton
    assert enc.render_chat(body) == "TOOLSy"
    assert enc.describe()["tool_template_skeletons"]["skeleton_renders"] == 1


def test_text_completions_get_the_tokenizers_special_tokens() -> None:
    enc = engine()
    got = ids(enc.encode(COMPLETIONS, {"prompt": "the cache holds the prefix"}))
    assert got == TOK.encode("the cache holds the prefix").ids and got[0] == 0
    bare = ids(enc.encode(COMPLETIONS, {"prompt": ["x y"], "add_special_tokens": False}))
    assert bare == TOK.encode("x y", add_special_tokens=False).ids


@pytest.mark.parametrize("encoder", [engine(), ApproxPromptEncoder(ApproxTokenizer())])
def test_token_id_prompts_pass_as_they_are(encoder: Any) -> None:
    for prompt in (list(range(40)), [list(range(40))]):
        tokens = encoder.encode(COMPLETIONS, {"prompt": prompt})
        assert tokens.packed == pack_token_ids(range(40)) and tokens.n_tokens == 40


def test_cache_salt_is_carried() -> None:
    tokens = engine().encode(COMPLETIONS, {"prompt": "x", "cache_salt": "tenant-a"})
    assert tokens.cache_salt == "tenant-a"
    assert engine().encode(COMPLETIONS, {"prompt": "x"}).cache_salt is None


def test_the_segment_cache_never_changes_the_ids() -> None:
    enc, uncached = engine(), engine(segment_cache_bytes=0)
    assert enc.segments.exact
    for i in range(30):
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"q{i} " * i},
            ]
        }
        assert enc.encode(CHAT_PATH, body).packed == uncached.encode(CHAT_PATH, body).packed
    assert uncached.segments.cached_bytes == 0 and enc.segments.cached_bytes > 0


def test_approx_encoder_is_todays_behaviour() -> None:
    tok = ApproxTokenizer(4.0)
    enc = ApproxPromptEncoder(tok)
    assert not enc.exact
    msgs = [{"role": "system", "content": "be brief " * 9}, {"role": "user", "content": "héllo"}]
    assert ids(enc.encode(CHAT_PATH, {"messages": msgs})) == tok.encode(chat_prompt_text(msgs))
    assert ids(enc.encode(COMPLETIONS, {"prompt": "héllo wörld"})) == tok.encode("héllo wörld")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, -1]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "cache_salt": 3}, "cache_salt"),
        (COMPLETIONS, {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        (CHAT_PATH, {"messages": []}, "messages"),
        (
            CHAT_PATH,
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1},
            "chat_template_kwargs",
        ),
        (
            CHAT_PATH,
            {
                "messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": {"tokenize": True},
            },
            "chat_template_kwargs",
        ),
        (
            CHAT_PATH,
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "messages",
        ),
    ],
)
def test_bad_requests_name_the_parameter(path: str, body: dict[str, Any], param: str) -> None:
    with pytest.raises(PromptError) as err:
        engine().encode(path, body)
    assert err.value.param == param and str(err.value)


def test_template_errors_and_missing_templates_are_request_errors() -> None:
    strict = engine("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(PromptError, match="roles must alternate"):
        strict.encode(CHAT_PATH, {"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(PromptError, match="no chat template"):
        engine(None).encode(CHAT_PATH, {"messages": [{"role": "user", "content": "x"}]})
    assert engine(None).encode(COMPLETIONS, {"prompt": "x"}).n_tokens > 0


LONG_USER = "a long document about caches and prefixes, line after line. " * 40


def _ahead(enc: EnginePromptEncoder, path: str, body: dict[str, Any], min_chars: int = 100):
    """What the gateway does with a long prompt: the work in a thread, then encode."""
    work = enc.prepare(path, body, min_chars)
    assert work is not None
    enc.accept(work, work.run())
    return work


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT_PATH, {"messages": [{"role": "user", "content": LONG_USER}]}),
        (
            CHAT_PATH,
            {"messages": [{"role": "user", "content": LONG_USER}], "add_special_tokens": True},
        ),
        (COMPLETIONS, {"prompt": LONG_USER}),
        (COMPLETIONS, {"prompt": LONG_USER, "add_special_tokens": False}),
    ],
)
def test_tokenizing_ahead_gives_the_same_ids_and_leaves_encode_nothing_to_do(
    path: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = engine().encode(path, body).packed
    enc = engine()
    _ahead(enc, path, body)
    import routing.prompt_encoder as module
    import routing.token_segments as segments

    def no_tokenizing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("encode tokenized what was done ahead")

    monkeypatch.setattr(module, "token_ids", no_tokenizing)
    monkeypatch.setattr(segments, "token_ids", no_tokenizing)
    assert enc.encode(path, body).packed == expected


def test_only_the_stretches_the_cache_lacks_are_work_and_short_work_stays_on_the_loop() -> None:
    enc = engine()
    first = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]}
    enc.encode(CHAT_PATH, first)  # the system prompt is now cached
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": LONG_USER}]
    }
    work = enc.prepare(CHAT_PATH, body, 100)
    assert work is not None
    assert [text for text, _, _ in work.jobs] == ["user\n" + LONG_USER]
    assert work.chars == len("user\n" + LONG_USER)
    assert enc.prepare(CHAT_PATH, body, work.chars + 1) is None  # below the threshold
    assert enc.prepare(CHAT_PATH, first, 100) is None  # nothing left to tokenize


def test_malformed_requests_are_left_to_encode_and_the_approx_encoder_has_no_work() -> None:
    enc = engine()
    assert enc.prepare(CHAT_PATH, {"messages": "nope"}, 1) is None
    assert enc.prepare(COMPLETIONS, {"prompt": ""}, 1) is None
    assert enc.prepare(COMPLETIONS, {"prompt": list(range(5000))}, 1) is None  # token ids
    approx = ApproxPromptEncoder(ApproxTokenizer())
    assert approx.prepare(COMPLETIONS, {"prompt": LONG_USER}, 1) is None


def test_whole_texts_done_ahead_are_taken_once_and_bounded() -> None:
    enc = engine()
    body = {"prompt": LONG_USER}
    work = _ahead(enc, COMPLETIONS, body)
    assert enc.encode(COMPLETIONS, body).packed == work.run()[0]
    assert not enc._ready  # taken: a whole text is not kept beyond its request
    for i in range(40):  # results no request asked for (it failed before encoding): bounded
        _ahead(enc, COMPLETIONS, {"prompt": f"{i} {LONG_USER}"})
    assert len(enc._ready) == 16


def test_a_chat_prepared_for_is_rendered_once(monkeypatch: pytest.MonkeyPatch) -> None:
    renders = 0
    real = EnginePromptEncoder.render_chat

    def counted(self: EnginePromptEncoder, *args: Any, **kwargs: Any) -> str:
        nonlocal renders
        renders += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EnginePromptEncoder, "render_chat", counted)
    enc = engine()
    body = {"messages": [{"role": "user", "content": "short"}]}
    other = {"messages": [{"role": "user", "content": "other"}]}
    assert enc.prepare(CHAT_PATH, body, 10_000) is None  # too short, but rendered to know
    enc.encode(CHAT_PATH, body)
    assert renders == 1
    enc.prepare(CHAT_PATH, body, 10_000)
    enc.encode(CHAT_PATH, other)  # another body: rendered itself
    enc.encode(CHAT_PATH, body)  # and this one's render was let go
    assert renders == 4


def test_describe_says_how_prompts_become_tokens() -> None:
    enc = engine()
    for user in ("first", "second"):
        enc.encode(CHAT_PATH, {"messages": [{"role": "user", "content": user}]})
    seen = enc.describe()
    assert seen["exact"] and seen["chat_template"] and seen["segment_cache_bytes"] > 0
    assert seen["template_skeletons"]["skeleton_renders"] == 1  # the second, same shape
    assert seen["template_skeletons"]["shapes_learned"] == 1
    assert engine(skeletons=False).describe()["template_skeletons"] is None
    approx = ApproxPromptEncoder(ApproxTokenizer(4.0)).describe()
    assert approx == {"exact": False, "tokenizer": "ApproxTokenizer(chars_per_token=4.0)"}
