"""A chat prompt rendered from its shape's skeleton, without running the template.

Two requests whose conversations have the same *shape* (routing/chat_shape.py: roles, keys,
which texts are empty, text parts and tool calls per message, ``add_generation_prompt``, the
template kwargs, the tools offered) get, from most chat templates, the same literal text with
each variable value (a content, a name, a tool call's id, function name or arguments) spliced
in, sometimes trimmed or, for arguments, as JSON. The skeleton of a shape is learned once by
rendering the template on stand-ins for those values (routing/chat_probes.py) that refuse to
be looked at: a template that compares, searches, measures, slices or serializes one (Qwen3
splitting reasoning at ``</think>``, a ``tojson`` of the messages ...) makes that shape
ineligible, and it keeps the full render. Every new skeleton is checked against the full
render once, and so is every ``verify_every``-th request after: a mismatch turns skeletons off
for the template for good (a warning says where the texts differ). ``strftime_now`` (Llama 3's
date line) is replayed too: a skeleton holds the formats it was called with and what they
gave, and is learned again when the clock says otherwise.

Why: jinja takes ~7.5 µs of the ~14 µs kvgate spends rendering a two-message chat (the rest
is rebuilding the messages as vLLM does and the request's kwargs), on every request; a
skeleton takes ~2.5 µs, its shape's key included (docs/real-engines.md section 1). kvgate
never sends this text anywhere: it is tokenized for block keys only, so even a wrong
skeleton would cost routing accuracy, not a wrong answer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing.chat_probes import (
    CLOSE,
    OPEN,
    PROBE_FILTERS,
    SLOT,
    ContentInspected,
    probe_join,
    replay,
)
from routing.chat_shape import Shape, conversation_shape, probe_conversation
from routing.chat_template import ChatTemplate, ChatTemplateError

log = logging.getLogger(__name__)
_GIVE_UP_AFTER = 32  # ineligible shapes, with fewer than one in 8 eligible: skeletons off


@dataclass(frozen=True, slots=True)
class _Skeleton:
    text: str  # the rendered literal text, ``{}`` where a value goes (``{``/``}`` doubled)
    slots: tuple[tuple[int, tuple[str, ...]], ...]  # per ``{}``: value (slot) index, transforms
    clock: tuple[tuple[str, str], ...]  # strftime_now calls: (format, what it gave)

    def fill(self, values: Sequence[Any]) -> str:
        return self.text.format(
            *[replay(values[i], ops) if ops else values[i] for i, ops in self.slots]
        )


# What a shape whose template reads its values maps to: the template renders those.
_INELIGIBLE = _Skeleton("", (), ())


class ChatSkeletons:
    """``template.render`` for the requests whose shape has a skeleton (module docstring)."""

    __slots__ = (
        "_clock_calls", "_probe", "_shapes", "_template", "checks", "ineligible",
        "learned", "max_shapes", "off", "off_reason", "skeleton_renders", "verify_every",
    )  # fmt: skip

    def __init__(
        self, template: ChatTemplate, *, max_shapes: int = 512, verify_every: int = 64
    ) -> None:
        self._template = template
        self.max_shapes = max_shapes
        self.verify_every = verify_every
        # shape -> its skeleton, or _INELIGIBLE where the template reads the values
        self._shapes: OrderedDict[Shape, _Skeleton] = OrderedDict()
        self._clock_calls: list[tuple[str, str]] = []
        self.skeleton_renders = self.learned = self.ineligible = self.checks = 0
        self.off = False
        self.off_reason: str | None = None
        self._probe: ChatTemplate | None = None
        try:
            self._probe = ChatTemplate(
                template.source,
                template.special_tokens,
                # Only where the template has a clock: "strftime_now is defined" must agree.
                strftime=self._strftime if template.now is not None else None,
                filters=PROBE_FILTERS,
                concat=probe_join,
            )
        except ChatTemplateError as exc:  # another jinja: no skeletons, renders as ever
            log.info("chat template skeletons unavailable: %s", exc)
            self._turn_off(f"unavailable: {exc}")

    def stats(self) -> dict[str, Any]:
        """What the admin API shows: chats spliced, shapes learned or left to the template,
        checks against the template, and whether (and why) skeletons are off."""
        return {
            "skeleton_renders": self.skeleton_renders,
            "shapes_learned": self.learned,
            "shapes_ineligible": self.ineligible,
            "checks": self.checks,
            "off": self.off,
            "off_reason": self.off_reason,
        }

    def _turn_off(self, reason: str) -> None:
        self.off, self.off_reason = True, reason
        self._shapes.clear()

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
        if not (self.off or documents is not None or continue_final_message):
            found = conversation_shape(messages, add_generation_prompt, extra, tools)
        if found is None:
            return self._template.render(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                documents=documents,
                **extra,
            )
        shape, values = found
        skeleton = self._shapes.get(shape)  # one lookup: the key is a nested tuple, rehashed
        if skeleton is None or self._clock_moved(skeleton):
            return self._learn(shape, messages, add_generation_prompt, tools, extra, values)
        self._shapes.move_to_end(shape)
        if skeleton is _INELIGIBLE:
            return self._full(messages, add_generation_prompt, tools, extra)
        text = skeleton.fill(values)
        self.skeleton_renders += 1
        if self.verify_every and self.skeleton_renders % self.verify_every == 0:
            full = self._full(messages, add_generation_prompt, tools, extra)
            if not self._check(text, full):
                return full
        return text

    def _full(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        extra: Mapping[str, Any],
    ) -> str:
        """The template's own render (raises as ever for a conversation it refuses)."""
        return self._template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )

    def _learn(
        self,
        shape: Shape,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        extra: Mapping[str, Any],
        values: Sequence[Any],
    ) -> str:
        full = self._full(messages, add_generation_prompt, tools, extra)
        skeleton = self._skeleton(messages, add_generation_prompt, tools, extra)
        if skeleton is _INELIGIBLE:
            self.ineligible += 1
            if self.ineligible >= _GIVE_UP_AFTER and self.learned * 8 < self.ineligible:
                # A template that reads most shapes' values: the shape keys cost more than the
                # few skeletons save.
                self._turn_off("the template reads most conversations' texts")
                log.info("chat template skeletons off: the template reads most conversations")
                return full
        else:
            self.learned += 1
            if not self._check(skeleton.fill(values), full):
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
        tools: Sequence[Mapping[str, Any]] | None,
        extra: Mapping[str, Any],
    ) -> _Skeleton:
        assert self._probe is not None
        probes = probe_conversation(messages)
        self._clock_calls = []
        try:
            text = str.__str__(
                self._probe.render(
                    probes, add_generation_prompt=add_generation_prompt, tools=tools, **extra
                )
            )
        except (ContentInspected, ChatTemplateError):
            return _INELIGIBLE
        literal: list[str] = []
        slots: list[tuple[int, tuple[str, ...]]] = []
        at = 0
        for m in SLOT.finditer(text):
            literal.append(_escape(text[at : m.start()]))
            literal.append("{}")
            slots.append((int(m.group(1)), tuple(op for op in m.group(2).split(".") if op)))
            at = m.end()
        literal.append(_escape(text[at:]))
        joined = "".join(literal)
        if OPEN in joined or CLOSE in joined:
            return _INELIGIBLE  # a marker was cut or escaped: the template worked on it
        return _Skeleton(joined, tuple(slots), tuple(self._clock_calls))

    def _strftime(self, fmt: str) -> str:
        now = self._template.now
        if now is None:  # the template renders without a clock: so does its probe
            raise ChatTemplateError("strftime_now needs a clock")
        value = now().strftime(fmt)
        self._clock_calls.append((fmt, value))
        return value

    def _clock_moved(self, skeleton: _Skeleton) -> bool:
        now = self._template.now
        if not skeleton.clock or now is None:
            return False
        at = now()
        return any(at.strftime(fmt) != value for fmt, value in skeleton.clock)

    def _check(self, skeleton_text: str, full: str) -> bool:
        self.checks += 1
        if skeleton_text == full:
            return True
        at = next(
            (i for i, (a, b) in enumerate(zip(skeleton_text, full, strict=False)) if a != b),
            min(len(skeleton_text), len(full)),
        )
        # Where, not what: the texts are users' prompts.
        self._turn_off(f"a skeleton differed from the template at character {at}")
        log.warning(
            "chat template skeletons turned off for this model: a skeleton's prompt differs "
            "from the template's at character %d (%d vs %d characters); the template renders "
            "every chat from now on",
            at,
            len(skeleton_text),
            len(full),
        )
        return False


def _escape(literal: str) -> str:
    return literal.replace("{", "{{").replace("}", "}}")
