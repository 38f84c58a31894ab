"""A model's chat template, rendered the way its engine renders it.

vLLM renders chat through Hugging Face's ``apply_chat_template``: a sandboxed jinja2
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``{% generation %}`` block, a ``tojson`` filter that does not HTML-escape, ``raise_exception``
and ``strftime_now`` globals, the tokenizer's named special tokens (``bos_token`` ...) as
variables, and ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` plus any
extra keyword. This module reproduces that so the rendered text, and so the token ids, equal
the engine's. No clock is read here: ``strftime_now`` uses the clock the caller hands in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from datetime import datetime
from typing import Any, ClassVar, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from config.errors import KvgateError

ContentFormat = Literal["string", "openai"]
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for continue_final_message


class ChatTemplateError(KvgateError, ValueError):
    """The template does not compile, or rejected a conversation while rendering."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (HF tracks assistant
    spans with it; the text is unchanged)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def hf_tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' override: jinja's own tojson HTML-escapes, which changes the prompt.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class ChatTemplate:
    """A compiled chat template.

    ``special_tokens``: the tokenizer's named special tokens (``{"bos_token": "<s>", ...}``),
    visible to the template as variables. ``now``: the clock behind ``strftime_now`` (the
    edge passes ``datetime.now``); without one, a template that calls it fails to render.
    ``strftime``, ``filters`` and ``concat`` replace ``strftime_now``, filters by name and
    the ``~`` operator (routing/chat_skeleton.py watches a template through them).
    """

    __slots__ = ("_content_format", "_now", "_source", "_special", "_template", "_variables")

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str],
        *,
        now: Callable[[], datetime] | None = None,
        strftime: Callable[[str], str] | None = None,
        filters: Mapping[str, Callable[..., Any]] | None = None,
        concat: Callable[[Sequence[Any]], str] | None = None,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = hf_tojson
        env.filters.update(filters or {})
        env.globals["raise_exception"] = _raise_exception
        if strftime is not None:
            env.globals["strftime_now"] = strftime
        elif now is not None:
            clock = now
            env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"line {exc.lineno}: {exc.message}") from None
        if concat is not None:
            # ``~`` compiles to a call of the name ``str_join``, imported from jinja's runtime
            # into the compiled template's own module namespace: replaced there, for this
            # template only. A jinja without that name is refused here (the skeletons, the
            # only user, then stay off).
            names = self._template.root_render_func.__globals__
            if "str_join" not in names:
                raise ChatTemplateError("this jinja2 compiles '~' differently: no str_join")
            names["str_join"] = concat
        self._now = now
        self._source = source
        self._special = dict(special_tokens)
        self._variables = frozenset(meta.find_undeclared_variables(ast))
        self._content_format: ContentFormat = (
            "openai" if any(True for _ in _content_loops(ast)) else "string"
        )

    @property
    def source(self) -> str:
        return self._source

    @property
    def special_tokens(self) -> Mapping[str, str]:
        return self._special

    @property
    def now(self) -> Callable[[], datetime] | None:
        return self._now

    @property
    def variables(self) -> frozenset[str]:
        """Names the template reads from its context (vLLM passes request kwargs only if
        the template uses them)."""
        return self._variables

    @property
    def content_format(self) -> ContentFormat:
        """``"openai"`` when the template loops over a message's content parts (vLLM then
        hands content as a list of parts), else ``"string"`` (parts joined by newlines)."""
        return self._content_format

    @property
    def supports_developer_role(self) -> bool:
        # vLLM's test: the template names the role; otherwise developer -> system.
        return '"developer"' in self._source or "'developer'" in self._source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text; raises ``ChatTemplateError`` with the template's own message
        (``raise_exception``) or jinja's."""
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt are not compatible"
            )
        chat: Any = messages
        final = ""
        if continue_final_message:
            chat, final = self._tag_final_message(messages)
        context = {**self._special, **extra}
        try:
            text = self._template.render(
                messages=chat,
                tools=list(tools) if tools is not None else None,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # Sandboxed templates still call Python (str methods, filters) on request data.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None
        if continue_final_message:
            text = _cut_at_tag(text, final)
        return text

    def _tag_final_message(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[list[dict[str, Any]], str]:
        # transformers marks the end of the final message, renders, then cuts there.
        if not messages:
            raise ChatTemplateError("continue_final_message needs a final message")
        chat = [dict(m) for m in messages]
        last = chat[-1] = deepcopy(chat[-1])
        content = last.get("content")
        if content is None:
            raise ChatTemplateError('continue_final_message: the final message has no "content"')
        if isinstance(content, list):
            for part in reversed(content):
                if isinstance(part, dict) and "text" in part:
                    final = str(part["text"])
                    part["text"] = final + _CONTINUE_TAG
                    return chat, final
            raise ChatTemplateError("continue_final_message: the final message has no text")
        final = str(content)
        last["content"] = final + _CONTINUE_TAG
        return chat, final

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self._source)} chars, content_format={self._content_format!r})"


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the template dropped part of the final message"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


# --- content format detection (vLLM's renderers/hf.py, _detect_content_format) -------------


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == key
        )
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _reads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """``name`` (or ``name.key``), possibly through a filter, a test or a slice."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    return _is_item(node, name, key) if key else _is_name(node, name)


def _aliases(root: jinja2.nodes.Node, name: str) -> list[str]:
    """``name`` and every variable assigned from it (``{% set msgs = messages[1:] %}``)."""
    found, queue = [name], [name]
    while queue:
        current = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (
                _reads(assign.node, current)
                and isinstance(target, jinja2.nodes.Name)
                and target.name not in found
            ):
                found.append(target.name)
                queue.append(target.name)
    return found


def _loop_target(loop: jinja2.nodes.For) -> str | None:
    return loop.target.name if isinstance(loop.target, jinja2.nodes.Name) else None


def _content_loops(root: jinja2.nodes.Template) -> Iterator[jinja2.nodes.For]:
    """Loops over a message's content parts, directly or through a macro parameter."""
    message_names = [
        target
        for loop in root.find_all(jinja2.nodes.For)
        if any(_reads(loop.iter, m) for m in _aliases(root, "messages"))
        and (target := _loop_target(loop)) is not None
    ]
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(jinja2.nodes.Macro):
        names = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_reads(arg, m, "content") for m in message_names):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in names and any(_reads(kw.value, m, "content") for m in message_names):
                    content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                params_by_loop[id(loop)] = content_params
    for loop in root.find_all(jinja2.nodes.For):
        if _loop_target(loop) is None:
            continue
        it = loop.iter
        direct = any(_reads(it, m, "content") for m in message_names)
        via_name = isinstance(it, jinja2.nodes.Name) and (
            it.name in params_by_loop.get(id(loop), ())
            or (id(loop) not in in_macros and it.name == "content")
        )
        if direct or via_name:
            yield loop
