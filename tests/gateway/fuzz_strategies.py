"""Hypothesis strategies for hostile input, shared by the fuzz suites: odd Unicode (NULs,
lone surrogates, RTL, emoji), huge and non-finite numbers, deep nesting, wrong types,
duplicated keys (``Pairs``), bytes that are not JSON, odd and enormous header values."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Deterministic (derandomize, no example database), no deadline: the box is small and shared.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


class Raw:
    """JSON text placed as it is (NaN, Infinity, 1e999, bytes that are not JSON)."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text!r})"


class Pairs(list):
    """A JSON object as key/value pairs: keys may repeat."""


def dump(value: Any, ascii: bool = True) -> bytes:
    """JSON bytes of ``value``; ``Raw`` and ``Pairs`` as they are. ``ascii``: non-ASCII as
    \\u escapes (lone surrogates too), else as raw UTF-8 (lone surrogates as invalid bytes)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        items = (dump(k, ascii) + b":" + dump(v, ascii) for k, v in value)
        return b"{" + b",".join(items) + b"}"
    if isinstance(value, dict):
        return dump(Pairs(value.items()), ascii)
    if isinstance(value, list):
        return b"[" + b",".join(dump(v, ascii) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=ascii).encode("utf-8", "surrogatepass")


ODD_TEXT = st.sampled_from(
    [
        "\u0000\ud800",  # the crash of issue 12: a NUL and a lone high surrogate
        "\ud800",
        "a\udfffb",
        "\udbff\udfff",  # a valid pair, escaped
        "\x00\x00\x00",
        "\u202eevil\u202c",  # RTL override
        "\u200f\u05e9\u05dc\u05d5\u05dd",  # RLM + Hebrew
        "😀👩‍👩‍👧‍👦🏳️‍🌈",
        "\ufeff\uffff\U0010ffff",
        "e\u0301" * 50,  # combining marks
        "",
        " ",
        "x" * 5000,
    ]
) | st.text(st.characters(codec=None, categories=None), max_size=40)
HUGE_NUMBERS = st.sampled_from(
    [0, -1, 1, 2**31, 2**32, 2**63, 2**70, -(2**70), 10**400, 1e308, -1e308, 5e-324, 0.5, 1.0]
) | st.sampled_from([Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b"-0")])
SCALARS = ODD_TEXT | HUGE_NUMBERS | st.sampled_from([None, True, False])
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
    max_leaves=12,
)
HEADER_VALUE = st.binary(min_size=0, max_size=40).map(
    lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F)
) | st.sampled_from([b"inf", b"-inf", b"nan", b"1e309", b"-0", b"0", b"1e-320", b"0x10", b" 5 "])
HEADERS = st.lists(
    st.tuples(
        st.sampled_from(
            [b"x-kvgate-priority", b"x-slo-ttft-ms", b"x-slo-tbt-ms", b"x-request-id",
             b"content-type", b"traceparent", b"x-unknown", b"authorization"]
        ),
        HEADER_VALUE,
    ),
    max_size=4,
)  # fmt: skip
