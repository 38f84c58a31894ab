"""A chat prompt rendered from its shape's skeleton, without running the template.

Two requests whose conversations have the same *shape* (the roles in order, which contents
are empty, how many text parts each has where the template takes content as parts,
``add_generation_prompt``, the template kwargs) get, from most chat templates, the same
literal text with each message's content spliced in, sometimes trimmed. The skeleton of
a shape is learned once by rendering the template on stand-ins for the contents (probes) that
refuse to be looked at: a template that compares, searches, measures, slices or serializes a
content (Qwen3 splitting reasoning at ``</think>``, a ``tojson`` of the messages ...) makes that
shape ineligible, and it keeps the full render. Trimming (``| trim``, ``.strip()``) and case
changes are recorded and replayed. Every new skeleton is checked against the full render
once, and so is every ``verify_every``-th request after: a mismatch turns skeletons off for
the template for good (a warning says so). ``strftime_now`` (Llama 3's date line) is replayed
too: a skeleton holds the formats it was called with and what they gave, and is learned
again when the clock says otherwise.

Why: jinja takes ~7.5 µs of the ~14 µs kvgate spends rendering a two-message chat (the rest
is rebuilding the messages as vLLM does and the request's kwargs), on every request; a
skeleton takes ~2.5 µs, its shape's key included (docs/real-engines.md section 1). kvgate
never sends this text anywhere: it is tokenized for block keys only, so even a wrong
skeleton would cost routing accuracy, not a wrong answer.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.filters

from routing.chat_template import ChatTemplate, ChatTemplateError, hf_tojson

log = logging.getLogger(__name__)

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: no template writes them
_SLOT = re.compile("\ue000(\\d+)((?:\\.[a-z]+)*)\ue001")
# A content's own transforms a skeleton can replay (trim and friends, case): no arguments.
_REPLAYABLE = frozenset({"strip", "lstrip", "rstrip", "lower", "upper"})
_SCALARS = (str, int, float, bool, type(None))


class ContentInspected(BaseException):
    """The template looked into a probe. A BaseException: jinja and the filters catch
    ``Exception`` in places (an AttributeError is how the sandbox falls back to item lookup),
    and this must reach the prober."""


def _inspected(self: Any, *args: Any) -> Any:
    raise ContentInspected


class _Probe(str):
    """A message content's stand-in: a slot marker (``\\ue000<i>[.op...]\\ue001``). It goes
    into the output as it is (``str()``, ``+`` and ``~`` keep it a probe); the replayable
    methods on a bare marker record themselves; anything else that would read the text
    raises ContentInspected."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):  # Python's own lookups (isinstance reads __class__)
            return str.__getattribute__(self, name)
        text = str.__str__(self)
        if name in _REPLAYABLE and _SLOT.fullmatch(text):

            def replay(chars: Any = None) -> _Probe:
                if chars is not None:
                    raise ContentInspected
                return _Probe(f"{text[:-1]}.{name}{_CLOSE}")

            return replay
        raise ContentInspected

    def __str__(self) -> str:
        return self

    def __add__(self, other: Any) -> _Probe:
        return _Probe(str.__add__(self, other))

    def __radd__(self, other: Any) -> _Probe:
        return _Probe(str.__add__(other, self))

    def __bool__(self) -> bool:
        # An empty content is no probe (emptiness is part of the shape), but a trimmed one
        # may be empty: its truth reads the text.
        if any(m.group(2) for m in _SLOT.finditer(str.__str__(self))):
            raise ContentInspected
        return True

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _inspected
    __hash__ = __contains__ = __len__ = __iter__ = __getitem__ = _inspected  # type: ignore[assignment]
    __mul__ = __rmul__ = __mod__ = __rmod__ = __format__ = __repr__ = _inspected  # type: ignore[assignment]


def _probe_join(seq: Sequence[Any]) -> str:
    """``~``: jinja's ``str_join``, keeping the result a probe when a part is one."""
    parts = tuple(seq)
    text = "".join(map(str, parts))
    return _Probe(text) if any(isinstance(p, _Probe) for p in parts) else text


def _holds_probe(x: Any) -> bool:
    if isinstance(x, _Probe):
        return True
    if isinstance(x, Mapping):
        return any(_holds_probe(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_probe(v) for v in x)
    return False


def _probe_tojson(x: Any, *args: Any, **kwargs: Any) -> str:
    if _holds_probe(x):
        raise ContentInspected  # JSON escapes the content: no splice can do that
    return hf_tojson(x, *args, **kwargs)


@jinja2.pass_eval_context
def _probe_join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)  # a probe's characters: iterating it raises
    text = jinja2.filters.do_join(eval_ctx, items, d, attribute)
    return _Probe(text) if _holds_probe(items) else text


def _refuse_probes(name: str) -> Callable[..., Any]:
    """A filter that copies its input's text into a new plain string (which the probe then
    no longer marks): refused when a probe is among its arguments."""
    real = jinja2.filters.FILTERS[name]

    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        if _holds_probe(value) or _holds_probe(args) or _holds_probe(kwargs):
            raise ContentInspected
        return real(value, *args, **kwargs)

    return guarded


_PROBE_FILTERS: dict[str, Callable[..., Any]] = {
    "tojson": _probe_tojson,
    "join": _probe_join_filter,
    **{name: _refuse_probes(name) for name in ("format", "escape", "e", "forceescape")},
}


@dataclass(frozen=True, slots=True)
class _Skeleton:
    text: str  # the rendered literal text, ``{}`` where a content goes (``{``/``}`` doubled)
    slots: tuple[tuple[int, tuple[str, ...]], ...]  # per ``{}``: text (slot) index, transforms
    clock: tuple[tuple[str, str], ...]  # strftime_now calls: (format, what it gave)

    def fill(self, contents: Sequence[str]) -> str:
        values = []
        for i, ops in self.slots:
            value = contents[i]
            for op in ops:
                value = getattr(value, op)()
            values.append(value)
        return self.text.format(*values)


class ChatSkeletons:
    """``template.render`` for the requests whose shape has a skeleton (module docstring)."""

    __slots__ = (
        "_clock_calls", "_probe", "_shapes", "_template", "checks", "ineligible",
        "learned", "max_shapes", "off", "skeleton_renders", "verify_every",
    )  # fmt: skip

    def __init__(
        self, template: ChatTemplate, *, max_shapes: int = 512, verify_every: int = 64
    ) -> None:
        self._template = template
        self.max_shapes = max_shapes
        self.verify_every = verify_every
        # shape -> its skeleton, or None where the template reads the contents (full render)
        self._shapes: OrderedDict[tuple[Any, ...], _Skeleton | None] = OrderedDict()
        self._clock_calls: list[tuple[str, str]] = []
        self.skeleton_renders = self.learned = self.ineligible = self.checks = 0
        self.off = False
        self._probe: ChatTemplate | None = None
        try:
            self._probe = ChatTemplate(
                template.source,
                template.special_tokens,
                strftime=self._strftime,
                filters=_PROBE_FILTERS,
                concat=_probe_join,
            )
        except ChatTemplateError as exc:  # another jinja: no skeletons, renders as ever
            log.info("chat template skeletons unavailable: %s", exc)
            self.off = True

    def stats(self) -> dict[str, Any]:
        """What the admin API shows: chats spliced, shapes learned or left to the template,
        checks against the template, and whether a disagreement turned skeletons off."""
        return {
            "skeleton_renders": self.skeleton_renders,
            "shapes_learned": self.learned,
            "shapes_ineligible": self.ineligible,
            "checks": self.checks,
            "off": self.off,
        }

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
        """What ``template.render`` returns for the same arguments."""
        found = None
        if not (self.off or tools is not None or documents is not None or continue_final_message):
            found = _shape(messages, add_generation_prompt, extra)
        if found is None:
            return self._template.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                documents=documents,
                **extra,
            )
        shape, contents = found
        if shape not in self._shapes or self._clock_moved(self._shapes[shape]):
            return self._learn(shape, messages, add_generation_prompt, extra, contents)
        self._shapes.move_to_end(shape)
        skeleton = self._shapes[shape]
        if skeleton is None:
            return self._template.render(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
        text = skeleton.fill(contents)
        self.skeleton_renders += 1
        if self.verify_every and self.skeleton_renders % self.verify_every == 0:
            full = self._template.render(
                messages, add_generation_prompt=add_generation_prompt, **extra
            )
            if not self._check(text, full):
                return full
        return text

    def _learn(
        self,
        shape: tuple[Any, ...],
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
        contents: Sequence[str],
    ) -> str:
        full = self._template.render(
            messages, add_generation_prompt=add_generation_prompt, **extra
        )  # raises as ever for a conversation the template refuses
        skeleton = self._skeleton(messages, add_generation_prompt, extra)
        if skeleton is None:
            self.ineligible += 1
        else:
            self.learned += 1
            if not self._check(skeleton.fill(contents), full):
                return full
        self._shapes[shape] = skeleton
        self._shapes.move_to_end(shape)
        while len(self._shapes) > self.max_shapes:
            self._shapes.popitem(last=False)
        return full

    def _skeleton(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        extra: Mapping[str, Any],
    ) -> _Skeleton | None:
        assert self._probe is not None
        probes = _probes(messages)
        self._clock_calls = []
        try:
            text = str.__str__(
                self._probe.render(probes, add_generation_prompt=add_generation_prompt, **extra)
            )
        except (ContentInspected, ChatTemplateError):
            return None
        literal: list[str] = []
        slots: list[tuple[int, tuple[str, ...]]] = []
        at = 0
        for m in _SLOT.finditer(text):
            literal.append(_escape(text[at : m.start()]))
            literal.append("{}")
            slots.append((int(m.group(1)), tuple(op for op in m.group(2).split(".") if op)))
            at = m.end()
        literal.append(_escape(text[at:]))
        joined = "".join(literal)
        if _OPEN in joined or _CLOSE in joined:
            return None  # a marker was cut or escaped: the template worked on it
        return _Skeleton(joined, tuple(slots), tuple(self._clock_calls))

    def _strftime(self, fmt: str) -> str:
        now = self._template.now
        if now is None:  # the template renders without a clock: so does its probe
            raise ChatTemplateError("strftime_now needs a clock")
        value = now().strftime(fmt)
        self._clock_calls.append((fmt, value))
        return value

    def _clock_moved(self, skeleton: _Skeleton | None) -> bool:
        now = self._template.now
        if skeleton is None or not skeleton.clock or now is None:
            return False
        at = now()
        return any(at.strftime(fmt) != value for fmt, value in skeleton.clock)

    def _check(self, skeleton_text: str, full: str) -> bool:
        self.checks += 1
        if skeleton_text == full:
            return True
        self.off = True
        self._shapes.clear()
        at = next(
            (i for i, (a, b) in enumerate(zip(skeleton_text, full, strict=False)) if a != b),
            min(len(skeleton_text), len(full)),
        )
        # Where, not what: the texts are users' prompts.
        log.warning(
            "chat template skeletons turned off for this model: a skeleton's prompt differs "
            "from the template's at character %d (%d vs %d characters); the template renders "
            "every chat from now on",
            at,
            len(skeleton_text),
            len(full),
        )
        return False


def _shape(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, extra: Mapping[str, Any]
) -> tuple[tuple[Any, ...], list[str]] | None:
    """The key of a conversation's shape and its texts in order; None when a skeleton cannot
    stand for it (a message with more than a role and a content, a content neither a string
    nor a list of text parts as vLLM builds them, a kwarg that is not a plain value)."""
    roles: list[tuple[str, Any]] = []
    texts: list[str] = []
    for m in messages:
        content = m.get("content")
        role = m.get("role")
        if len(m) != 2 or type(role) is not str:
            return None
        if type(content) is str:
            roles.append((role, content != ""))
            texts.append(content)
        elif type(content) is list:  # the "openai" content format: [{"type": "text", ...}]
            for part in content:
                if type(part) is not dict or len(part) != 2 or part.get("type") != "text":
                    return None
                text = part.get("text")
                if type(text) is not str:
                    return None
                texts.append(text)
            roles.append((role, tuple(t != "" for t in texts[len(texts) - len(content) :])))
        else:
            return None
    for value in extra.values():
        if not isinstance(value, _SCALARS):
            return None
    return (add_generation_prompt, tuple(roles), tuple(sorted(extra.items()))), texts


def _probes(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each non-empty text replaced by its slot's probe (slots count
    texts in order, parts included)."""
    out: list[dict[str, Any]] = []
    slot = 0

    def probe(text: str) -> str:
        nonlocal slot
        slot += 1
        return _Probe(f"{_OPEN}{slot - 1}{_CLOSE}") if text else ""

    for m in messages:
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": probe(content)})
        else:
            parts = [{"type": "text", "text": probe(p["text"])} for p in content]
            out.append({"role": m["role"], "content": parts})
    return out


def _escape(literal: str) -> str:
    return literal.replace("{", "{{").replace("}", "}}")
