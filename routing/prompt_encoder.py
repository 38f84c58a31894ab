"""A request body -> the prompt's token ids, as the gateway hashes them.

Two encoders. ``EnginePromptEncoder`` tokenizes exactly as the model's engine (vLLM 0.32) does:
chat messages rebuilt as vLLM rebuilds them, rendered with the model's chat template, then
tokenized without adding special tokens (the template already has them; a request may ask
otherwise with ``add_special_tokens``); a text completion prompt tokenized *with* the
tokenizer's special tokens (its post-processor adds BOS where the model wants one). Token-id
prompts pass as they are. ``ApproxPromptEncoder`` is the zero-config fallback: messages joined
as plain text and the approximate (or file) tokenizer; prefix *sharing* is right, the ids and
block boundaries are not the engine's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from routing.chat_messages import engine_conversation, engine_tools
from routing.chat_skeleton import ChatSkeletons
from routing.chat_template import ChatTemplate, ChatTemplateError
from routing.prompt import PromptError, chat_prompt_text
from routing.token_segments import EngineTokenizer, SegmentedEncoder, StretchEncoder, token_ids
from routing.tokenizer import Tokenizer, pack_token_ids

CHAT_PATH = "/v1/chat/completions"
_TOKEN_ID_LIMIT = 1 << 32  # block hashing packs ids as uint32
_READY_LIMIT = 16  # whole texts tokenized ahead and not yet asked for (a request that failed)
# apply_chat_template's own parameters: consumed there, never template variables.
_HF_PARAMS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


@dataclass(slots=True)  # per request: not frozen (see routing/types.py)
class PromptTokens:
    packed: bytes  # token ids as little-endian uint32 (routing.tokenizer.pack_token_ids)
    n_tokens: int
    cache_salt: str | None  # body "cache_salt" if given (vLLM's per-request cache namespace)


@dataclass(frozen=True, slots=True)
class PromptWork:
    """The tokenizing ``encode`` would do for one request, as a job for another thread: the
    Rust tokenizer releases the GIL, so a long prompt need not stall the event loop.
    ``jobs``: (text, add_special_tokens, whole) — ``whole`` for a text encoded in one piece,
    else a stretch of a rendered chat between added tokens (routing/token_segments.py)."""

    tokenizer: EngineTokenizer
    segments: SegmentedEncoder  # tokenizes the stretches (``whole`` False)
    jobs: tuple[tuple[str, bool, bool], ...]

    @property
    def chars(self) -> int:
        return sum(len(text) for text, _, _ in self.jobs)

    def run(self) -> list[bytes]:
        """The packed ids of each job; pure, so safe in a worker thread."""
        return [
            pack_token_ids(token_ids(self.tokenizer, text, add_special_tokens=add))
            if whole
            else self.segments.stretch(text)
            for text, add, whole in self.jobs
        ]


class PromptEncoder(Protocol):
    exact: bool  # True when token ids equal the engine's

    def encode(self, path: str, body: Mapping[str, Any]) -> PromptTokens: ...

    def prepare(self, path: str, body: Mapping[str, Any], min_chars: int) -> PromptWork | None:
        """The request's tokenizing as a job for another thread, when it is at least
        ``min_chars`` characters; None when smaller, or when the request is malformed
        (``encode`` then raises the error as always)."""
        ...

    def accept(self, work: PromptWork, results: list[bytes]) -> None:
        """``work.run()``'s results, kept so that the next ``encode`` of the request uses
        them; on the event loop's thread, as ``encode``."""
        ...

    def describe(self) -> dict[str, Any]:
        """How prompts become tokens here, for the admin API."""
        ...


def completion_prompt(body: Mapping[str, Any]) -> str | list[int]:
    """A completion's prompt: non-empty text, or token ids in [0, 2^32)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("'prompt' must not be empty", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        if not all(0 <= t < _TOKEN_ID_LIMIT for t in prompt):
            raise PromptError("token ids must be in [0, 2^32)", "prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise PromptError(
            "batched prompts are not supported; send one prompt per request", "prompt"
        )
    raise PromptError("'prompt' must be a string or an array of token ids", "prompt")


def cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise PromptError("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


def _tokens(packed: bytes, body: Mapping[str, Any]) -> PromptTokens:
    return PromptTokens(packed, len(packed) // 4, cache_salt(body))


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise PromptError(f"'{key}' must be a boolean", key)
    return value


def _unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "auto")


class ApproxPromptEncoder:
    """Messages joined as plain text (``chat_prompt_text``), then ``tokenizer``."""

    __slots__ = ("_tokenizer", "exact")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.exact = False

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def encode(self, path: str, body: Mapping[str, Any]) -> PromptTokens:
        if path == CHAT_PATH:
            return _tokens(self._pack(chat_prompt_text(body.get("messages"))), body)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            return _tokens(self._pack(prompt), body)
        return _tokens(pack_token_ids(prompt), body)

    def prepare(self, path: str, body: Mapping[str, Any], min_chars: int) -> PromptWork | None:
        return None  # characters over a ratio (or a small local tokenizer): cheap to do here

    def accept(self, work: PromptWork, results: list[bytes]) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"exact": False, "tokenizer": repr(self._tokenizer)}

    def _pack(self, text: str) -> bytes:
        pack = getattr(self._tokenizer, "pack", None)
        packed = pack(text) if pack is not None else None
        return packed if packed is not None else pack_token_ids(self._tokenizer.encode(text))

    def __repr__(self) -> str:
        return f"ApproxPromptEncoder({self._tokenizer!r})"


class EnginePromptEncoder:
    """The engine's own token ids, from its tokenizer (a ``tokenizers.Tokenizer``), its chat
    template (None: the model has none, and chat requests are refused as vLLM refuses them)."""

    __slots__ = (
        "_ready", "_rendered", "_segments", "_skeletons", "_template", "_tok", "_tool_skeletons",
        "_tool_template", "exact",
    )  # fmt: skip

    def __init__(
        self,
        tokenizer: EngineTokenizer,
        template: ChatTemplate | None,
        *,
        tool_template: ChatTemplate | None = None,
        segment_cache_bytes: int = 32 << 20,
        stretches: StretchEncoder | None = None,
        skeletons: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._template = template
        self._tool_template = tool_template  # a model's named "tool_use" template, if any
        # Chats rendered from skeletons (routing/chat_skeleton.py), one cache per template.
        self._skeletons = ChatSkeletons(template) if template is not None and skeletons else None
        self._tool_skeletons = (
            ChatSkeletons(tool_template) if tool_template is not None and skeletons else None
        )
        self._segments = SegmentedEncoder(
            tokenizer, max_bytes=segment_cache_bytes, stretches=stretches
        )
        # Whole texts tokenized in another thread (``accept``), taken by the next encode.
        self._ready: OrderedDict[tuple[str, bool], bytes] = OrderedDict()
        # The chat ``prepare`` rendered last, for the ``encode`` of the same body right after.
        self._rendered: tuple[Mapping[str, Any], str] | None = None
        self.exact = True

    @property
    def template(self) -> ChatTemplate | None:
        return self._template

    @property
    def segments(self) -> SegmentedEncoder:
        return self._segments

    @property
    def skeletons(self) -> ChatSkeletons | None:
        return self._skeletons

    def encode(self, path: str, body: Mapping[str, Any]) -> PromptTokens:
        if path == CHAT_PATH:
            text = self._render_once(body)
            if _flag(body, "add_special_tokens", False):
                return _tokens(self._encode_whole(text, True), body)
            if not self._segments.exact:
                return _tokens(self._encode_whole(text, False), body)
            return _tokens(self._segments.encode(text), body)
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            add = _flag(body, "add_special_tokens", True)
            return _tokens(self._encode_whole(prompt, add), body)
        return _tokens(pack_token_ids(prompt), body)

    def prepare(self, path: str, body: Mapping[str, Any], min_chars: int) -> PromptWork | None:
        try:
            jobs = self._jobs(path, body)
        except PromptError:
            return None
        work = PromptWork(self._tok, self._segments, tuple(jobs))
        return work if jobs and work.chars >= min_chars else None

    def _jobs(self, path: str, body: Mapping[str, Any]) -> list[tuple[str, bool, bool]]:
        """What ``encode`` would tokenize, taking the same branches."""
        if path == CHAT_PATH:
            text = self.render_chat(body)
            self._rendered = (body, text)
            if _flag(body, "add_special_tokens", False):
                return [(text, True, True)]
            if not self._segments.exact:
                return [(text, False, True)]
            return [(part, False, False) for part in self._segments.uncached(text)]
        prompt = completion_prompt(body)
        if isinstance(prompt, str):
            return [(prompt, _flag(body, "add_special_tokens", True), True)]
        return []

    def accept(self, work: PromptWork, results: list[bytes]) -> None:
        for (text, add, whole), ids in zip(work.jobs, results, strict=True):
            if not whole:
                self._segments.remember(text, ids)
                continue
            self._ready[(text, add)] = ids
            if len(self._ready) > _READY_LIMIT:
                self._ready.popitem(last=False)

    def describe(self) -> dict[str, Any]:
        segments = self._segments
        return {
            "exact": True,
            "chat_template": self._template is not None,
            "segment_cache_bytes": segments.cached_bytes if segments.exact else None,
            "stretches_on_tiktoken": segments.fast,
            "template_skeletons": self._skeletons.stats() if self._skeletons else None,
            "tool_template_skeletons": (
                self._tool_skeletons.stats() if self._tool_skeletons else None
            ),
        }

    def _render_once(self, body: Mapping[str, Any]) -> str:
        """``render_chat``, or what ``prepare`` rendered for this very body (held, so its
        identity cannot pass to another body meanwhile)."""
        done, self._rendered = self._rendered, None
        if done is not None and done[0] is body:
            return done[1]
        return self.render_chat(body)

    def _encode_whole(self, text: str, add_special_tokens: bool) -> bytes:
        ready = self._ready.pop((text, add_special_tokens), None) if self._ready else None
        if ready is not None:
            return ready
        return pack_token_ids(token_ids(self._tok, text, add_special_tokens=add_special_tokens))

    def render_chat(self, body: Mapping[str, Any]) -> str:
        """The chat prompt text vLLM renders for this request."""
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, Mapping):
            raise PromptError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        if bad := {"chat_template", "tokenize"} & user.keys():
            raise PromptError(
                f"unexpected chat template kwargs: {sorted(bad)}", "chat_template_kwargs"
            )
        # vLLM: request fields override the request's kwargs unless None or "auto".
        fields: dict[str, Any] = {
            "add_generation_prompt": _flag(body, "add_generation_prompt", True),
            "continue_final_message": _flag(body, "continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        if fields["reasoning_effort"] is not None and "enable_thinking" not in user:
            fields["enable_thinking"] = fields["reasoning_effort"] != "none"
        tools = engine_tools(body.get("tools"))
        kwargs: dict[str, Any] = {"tools": tools} if tools is not None else {}
        kwargs |= {k: v for k, v in user.items() if not _unset(v)}
        kwargs |= {k: v for k, v in fields.items() if not _unset(v)}
        template = self._template
        if kwargs.get("tools") is not None and self._tool_template is not None:
            template = self._tool_template
        if template is None:
            raise PromptError("the model has no chat template: use /v1/completions", "messages")
        conversation = engine_conversation(
            body.get("messages"),
            template.content_format,
            developer_role=template.supports_developer_role,
        )
        extra = {k: v for k, v in kwargs.items() if k in template.variables and k not in _HF_PARAMS}
        skeletons = self._skeletons if template is self._template else self._tool_skeletons
        render = skeletons.render if skeletons is not None else template.render
        try:
            return render(
                conversation,
                add_generation_prompt=bool(kwargs.get("add_generation_prompt", False)),
                tools=kwargs.get("tools"),
                continue_final_message=bool(kwargs.get("continue_final_message", False)),
                documents=kwargs.get("documents"),
                **extra,
            )
        except ChatTemplateError as exc:
            raise PromptError(f"chat template: {exc}", "messages") from None

    def __repr__(self) -> str:
        return (
            f"EnginePromptEncoder(template={self._template!r}, segments={self._segments.exact}, "
            f"fast_stretches={self._segments.fast})"
        )
