"""Stand-ins for a conversation's variable parts that a chat template may copy but not read.

A chat template rendered on probes instead of a request's texts shows where each text lands
in the prompt (routing/chat_skeleton.py). A ``TextProbe`` is a slot marker string
(``\\ue000<slot>[.op...]\\ue001``): it goes into the output as it is (``str()``, ``+`` and ``~``
keep it a probe), ``strip``/``lstrip``/``rstrip``/``lower``/``upper`` on a bare marker record
themselves, and anything else that reads the text (comparing, searching, measuring, slicing,
iterating, formatting, any other method) raises ``ContentInspected``; ``tojson`` of a bare
marker records ``.json``. An ``ArgumentsProbe`` stands for a tool call's parsed arguments: a
dict that only ``tojson`` may take, which records itself as ``.json``. The probe
environment's ``tojson``, ``join``, ``format`` and ``escape`` filters (``PROBE_FILTERS``) and
``~`` (``probe_join``) keep these rules where jinja would copy a probe into a plain string
unseen.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.filters

from routing.chat_template import hf_tojson

OPEN, CLOSE = "\ue000", "\ue001"  # private-use code points: no template writes them
SLOT = re.compile("\ue000(\\d+)((?:\\.[a-z]+)*)\ue001")
_QUOTED_SLOT = re.compile('"(\ue000\\d+(?:\\.[a-z]+)*\ue001)"')  # a marker as a JSON string
# A text's own transforms a skeleton can replay (trim and friends, case): no arguments.
_REPLAYABLE = frozenset({"strip", "lstrip", "rstrip", "lower", "upper"})


class ContentInspected(BaseException):
    """The template looked into a probe. A BaseException: jinja and the filters catch
    ``Exception`` in places (an AttributeError is how the sandbox falls back to item lookup),
    and this must reach the prober."""


def _inspected(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise ContentInspected


def marker(slot: int) -> str:
    return f"{OPEN}{slot}{CLOSE}"


class TextProbe(str):
    """A text's stand-in (module docstring)."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_"):  # Python's own lookups (isinstance reads __class__)
            return str.__getattribute__(self, name)
        text = str.__str__(self)
        if name in _REPLAYABLE and SLOT.fullmatch(text):

            def record(chars: Any = None) -> TextProbe:
                if chars is not None:
                    raise ContentInspected
                return TextProbe(f"{text[:-1]}.{name}{CLOSE}")

            return record
        raise ContentInspected

    def __str__(self) -> str:
        return self

    def __add__(self, other: Any) -> TextProbe:
        return TextProbe(str.__add__(self, other))

    def __radd__(self, other: Any) -> TextProbe:
        return TextProbe(str.__add__(other, self))

    def __bool__(self) -> bool:
        # An empty text is no probe (emptiness is part of the shape), but a trimmed one may
        # be empty: its truth reads the text.
        if any(m.group(2) for m in SLOT.finditer(str.__str__(self))):
            raise ContentInspected
        return True

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _inspected
    __hash__ = __contains__ = __len__ = __iter__ = __getitem__ = _inspected  # type: ignore[assignment]
    __mul__ = __rmul__ = __mod__ = __rmod__ = __format__ = __repr__ = _inspected  # type: ignore[assignment]


class ArgumentsProbe(dict):  # type: ignore[type-arg]
    """A tool call's (non-empty) arguments' stand-in: empty inside, readable by no one; only
    ``tojson`` with its default options takes it (``.json``)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        super().__init__()
        self.slot = slot

    def __bool__(self) -> bool:
        return True  # empty arguments are passed as they are: the shape says which

    __getitem__ = get = keys = values = items = __iter__ = __len__ = __contains__ = _inspected  # type: ignore[assignment]
    __eq__ = __ne__ = __repr__ = __str__ = __or__ = __ror__ = copy = _inspected  # type: ignore[assignment]


def probe_join(seq: Sequence[Any]) -> str:
    """``~``: jinja's ``str_join``, keeping the result a probe when a part is one."""
    parts = tuple(seq)
    text = "".join(map(str, parts))
    return TextProbe(text) if any(isinstance(p, TextProbe) for p in parts) else text


def holds_probe(x: Any) -> bool:
    if isinstance(x, (TextProbe, ArgumentsProbe)):
        return True
    if isinstance(x, Mapping):
        return any(holds_probe(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(holds_probe(v) for v in x)
    return False


def _probe_tojson(x: Any, *args: Any, **kwargs: Any) -> str:
    """JSON with the default options of a structure holding bare probes (a tool call's
    arguments, a tool result as ``{"output": ...}``): each probe's JSON string is recorded as
    ``.json`` on its marker. Other options, or a probe already combined with other text,
    would escape it out of sight."""
    if not holds_probe(x):
        return hf_tojson(x, *args, **kwargs)
    if args or kwargs:
        raise ContentInspected
    if type(x) is ArgumentsProbe:
        return TextProbe(f"{OPEN}{x.slot}.json{CLOSE}")
    text = hf_tojson(_unprobed(x))  # each probe now its bare marker, as a JSON string
    return TextProbe(_QUOTED_SLOT.sub(lambda m: f"{m.group(1)[:-1]}.json{CLOSE}", text))


def _unprobed(x: Any) -> Any:
    if type(x) is ArgumentsProbe:
        return marker(x.slot)
    if type(x) is TextProbe:
        text = str.__str__(x)
        if not SLOT.fullmatch(text):
            raise ContentInspected
        return text
    if isinstance(x, Mapping):
        if any(isinstance(k, TextProbe) for k in x):
            raise ContentInspected
        return {k: _unprobed(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_unprobed(v) for v in x]
    return x


@jinja2.pass_eval_context
def _probe_join_filter(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    items = list(value)  # a probe's characters: iterating it raises
    text = jinja2.filters.do_join(eval_ctx, items, d, attribute)
    return TextProbe(text) if holds_probe(items) else text


def _refuse_probes(name: str) -> Callable[..., Any]:
    """A filter that copies its input's text into a new plain string (which the probe then
    no longer marks): refused when a probe is among its arguments."""
    real = jinja2.filters.FILTERS[name]

    def guarded(value: Any, *args: Any, **kwargs: Any) -> Any:
        if holds_probe(value) or holds_probe(args) or holds_probe(kwargs):
            raise ContentInspected
        return real(value, *args, **kwargs)

    return guarded


PROBE_FILTERS: dict[str, Callable[..., Any]] = {
    "tojson": _probe_tojson,
    "join": _probe_join_filter,
    **{name: _refuse_probes(name) for name in ("format", "escape", "e", "forceescape")},
}


def replay(value: Any, ops: Sequence[str]) -> Any:
    """A slot's value with the transforms its marker recorded."""
    for op in ops:
        value = hf_tojson(value) if op == "json" else getattr(value, op)()
    return value
