"""backends/json_codec.py: orjson's speed, the standard library's answers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import json_codec

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(_values)
def test_loads_and_dumps_agree_with_the_standard_library(value: object) -> None:
    raw = json.dumps(value).encode()  # surrogates escaped, big integers exact
    assert json_codec.loads(raw) == json.loads(raw)
    assert json.loads(json_codec.dumps(value)) == value


def test_integers_beyond_64_bits_stay_exact() -> None:
    big = 123456789012345678901234567890
    assert json_codec.loads(f'{{"max_tokens": {big}}}'.encode()) == {"max_tokens": big}
    assert json_codec.loads(b"[9223372036854775807, 18446744073709551615]") == [
        9223372036854775807,
        18446744073709551615,
    ]
    assert json_codec.dumps({"n": 2**70}) == b'{"n":1180591620717411303424}'


def test_lone_surrogates_are_read_as_json_reads_them() -> None:
    assert json_codec.loads(b'{"prompt": "a\\ud800"}') == {"prompt": "a\ud800"}
    assert json.loads(json_codec.dumps({"prompt": "a\ud800"})) == {"prompt": "a\ud800"}


@pytest.mark.parametrize("raw", [b'{"t": NaN}', b"[Infinity]", b"-Infinity", b"\xff", b"{", b""])
def test_not_json_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        json_codec.loads(raw)


def test_nesting_beyond_the_parsers_is_a_recursion_error() -> None:
    with pytest.raises(RecursionError):
        json_codec.loads(b"[" * 100_000 + b"]" * 100_000)
