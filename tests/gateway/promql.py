"""A small PromQL parser for checking dashboards: syntax, known functions, and the metric names
an expression reads. Covers what dashboards use (selectors with matchers, range and subquery
brackets, offset, aggregations with by/without before or after the arguments, functions,
binary operators with bool/on/ignoring/group_left/group_right, numbers, strings) plus Grafana's
``$variables`` where a duration or a value goes. No PromQL parser ships on PyPI for Python that
the project could depend on, hence this one; it rejects what Prometheus would reject in that
subset and says where."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset(
    {
        "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
        "count_values", "group",
    }
)  # fmt: skip
FUNCTIONS = frozenset(
    {
        "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp",
        "clamp_max", "clamp_min", "count_over_time", "day_of_month", "day_of_week",
        "days_in_month", "delta", "deriv", "exp", "floor", "histogram_count",
        "histogram_fraction", "histogram_quantile", "histogram_sum", "holt_winters", "hour",
        "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time", "ln",
        "log10", "log2", "max_over_time", "min_over_time", "minute", "month", "predict_linear",
        "present_over_time", "quantile_over_time", "rate", "resets", "round", "scalar", "sgn",
        "sort", "sort_desc", "sqrt", "stddev_over_time", "stdvar_over_time", "sum_over_time",
        "time", "timestamp", "vector", "year",
    }
)  # fmt: skip
_BINARY = {
    "or": 1,
    "and": 2,
    "unless": 2,
    "==": 3,
    "!=": 3,
    ">": 3,
    "<": 3,
    ">=": 3,
    "<=": 3,
    "+": 4,
    "-": 4,
    "*": 5,
    "/": 5,
    "%": 5,
    "^": 6,
}
_TOKEN = re.compile(
    r"""\s*(?:
    (?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+)(?![\w.])
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|0x[0-9a-fA-F]+)
  | (?P<var>\$\{\w+(?::\w+)?\}|\$\w+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<ident>[A-Za-z_][\w:]*)
  | (?P<op>==|!=|=~|!~|>=|<=|[-+*/%^<>=(){}\[\],:@])
    )""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass(slots=True)
class _Tok:
    kind: str
    text: str
    pos: int


def tokenize(expr: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        m = _TOKEN.match(expr, pos)
        if m is None or m.lastgroup is None:
            raise PromQLError(f"unexpected character at {pos}: {expr[pos : pos + 20]!r}")
        out.append(_Tok(m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup)))
        pos = m.end()
    return out


@dataclass(slots=True)
class _Parser:
    expr: str
    toks: list[_Tok]
    i: int = 0
    metrics: set[str] = field(default_factory=set)

    def peek(self, ahead: int = 0) -> _Tok | None:
        j = self.i + ahead
        return self.toks[j] if j < len(self.toks) else None

    def take(self, text: str | None = None, kind: str | None = None) -> _Tok:
        t = self.peek()
        if t is None or (text is not None and t.text != text) or (kind and t.kind != kind):
            want = text or kind
            got = "the end" if t is None else repr(t.text)
            raise PromQLError(f"expected {want} but found {got} in {self.expr!r}")
        self.i += 1
        return t

    def at(self, text: str) -> bool:
        t = self.peek()
        return t is not None and t.text == text and t.kind in ("op", "ident")

    def parse(self) -> set[str]:
        self.expression(0)
        if self.peek() is not None:
            raise PromQLError(f"unexpected {self.peek().text!r} in {self.expr!r}")
        return self.metrics

    def expression(self, min_prec: int) -> None:
        self.unary()
        while (t := self.peek()) is not None and t.kind in ("op", "ident"):
            prec = _BINARY.get(t.text)
            if prec is None or prec < min_prec:
                return
            self.i += 1
            if self.at("bool"):
                self.i += 1
            if self.at("on") or self.at("ignoring"):
                self.i += 1
                self.labels()
                if self.at("group_left") or self.at("group_right"):
                    self.i += 1
                    if self.at("("):
                        self.labels()
            self.expression(prec if t.text == "^" else prec + 1)

    def unary(self) -> None:
        if self.at("-") or self.at("+"):
            self.i += 1
        self.primary()
        self.postfix()

    def primary(self) -> None:
        t = self.take()
        if t.kind in ("number", "string", "var"):
            return
        if t.text == "(":
            self.expression(0)
            self.take(")")
            return
        if t.text == "{":
            self.matchers()
            return
        if t.kind != "ident":
            raise PromQLError(f"unexpected {t.text!r} at {t.pos} in {self.expr!r}")
        if t.text in AGGREGATIONS:
            if self.at("by") or self.at("without"):
                self.i += 1
                self.labels()
            self.call_args()
            if self.at("by") or self.at("without"):
                self.i += 1
                self.labels()
            return
        if self.at("("):
            if t.text not in FUNCTIONS:
                raise PromQLError(f"unknown function {t.text!r} in {self.expr!r}")
            self.call_args()
            return
        if t.text in ("Inf", "NaN", "inf", "nan"):
            return
        self.metrics.add(t.text)
        if self.at("{"):
            self.i += 1
            self.matchers()

    def matchers(self) -> None:  # after '{'
        while not self.at("}"):
            self.take(kind="ident")
            op = self.take(kind="op")
            if op.text not in ("=", "!=", "=~", "!~"):
                raise PromQLError(f"bad label matcher {op.text!r} in {self.expr!r}")
            self.take(kind="string")
            if not self.at("}"):
                self.take(",")
        self.take("}")

    def labels(self) -> None:
        self.take("(")
        while not self.at(")"):
            self.take(kind="ident")
            if not self.at(")"):
                self.take(",")
        self.take(")")

    def call_args(self) -> None:
        self.take("(")
        while not self.at(")"):
            self.expression(0)
            if not self.at(")"):
                self.take(",")
        self.take(")")

    def duration(self) -> None:
        t = self.take()
        if t.kind not in ("duration", "var"):
            raise PromQLError(f"expected a duration, found {t.text!r} in {self.expr!r}")

    def postfix(self) -> None:
        if self.at("["):
            self.i += 1
            self.duration()
            if self.at(":"):
                self.i += 1
                if not self.at("]"):
                    self.duration()
            self.take("]")
        if self.at("offset"):
            self.i += 1
            self.duration()


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads; ``PromQLError`` if it does not parse."""
    toks = tokenize(expr)
    if not toks:
        raise PromQLError("empty expression")
    return _Parser(expr, toks).parse()
