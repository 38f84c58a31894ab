"""llama.cpp's slot layout from /slots and /props, on JSON captured from llama-server 0.3.36
(``-c 4096 -np 2``: two slots of 2048 tokens, one busy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.slots import SlotLayout, parse_props, parse_slots

DATA = Path(__file__).parent / "data"


def test_captured_slots_give_capacity_and_busy_slots() -> None:
    data = json.loads((DATA / "llamacpp_slots_busy.json").read_text())
    assert parse_slots(data) == SlotLayout(slots=2, context_tokens=2 * 2048, busy=1)


def test_captured_props_give_capacity_without_busy_count() -> None:
    data = json.loads((DATA / "llamacpp_props.json").read_text())
    assert parse_props(data) == SlotLayout(slots=2, context_tokens=2 * 2048, busy=None)


@pytest.mark.parametrize(
    "data",
    [[], {}, None, "x", [{"id": 0}], [{"n_ctx": 0}], [{"n_ctx": True}], [1, 2]],
)
def test_other_shapes_are_not_slots(data: object) -> None:
    assert parse_slots(data) is None


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"total_slots": 2},
        {"total_slots": 2, "default_generation_settings": {"n_ctx": "2048"}},
        {"total_slots": 0, "default_generation_settings": {"n_ctx": 2048}},
    ],
)
def test_other_shapes_are_not_props(data: object) -> None:
    assert parse_props(data) is None
