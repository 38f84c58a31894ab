"""llama.cpp's slot layout from ``/slots`` (or ``/props`` where ``/slots`` is disabled).

llama-server runs ``-np N`` parallel slots, each with its own context of ``n_ctx`` tokens
(``-c`` divided by N); a slot keeps the KV of its last prompt, which is the whole of its
prefix cache when the host prompt cache is off (``--cache-ram 0``). The KV capacity kvgate
should assume is therefore the sum of the slots' contexts, not a GPU profile's. ``/metrics``
has no such number. Shapes seen on llama-server 0.3.36 (tests/backends/data/llamacpp_*.json):
``/slots`` is a list of ``{"id", "n_ctx", "is_processing", ...}``; ``/props`` has
``total_slots`` and ``default_generation_settings.n_ctx`` (per slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SlotLayout:
    slots: int
    context_tokens: int  # summed over slots: the KV the engine can hold
    busy: int | None = None  # slots processing a request (None: not reported)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    n = int(value)
    return n if n > 0 else None


def parse_slots(data: Any) -> SlotLayout | None:
    """``/slots`` JSON -> layout; None when it is not the list of slots llama-server sends."""
    if not isinstance(data, list) or not data:
        return None
    contexts: list[int] = []
    busy = 0
    for slot in data:
        if not isinstance(slot, dict):
            return None
        n_ctx = _positive_int(slot.get("n_ctx"))
        if n_ctx is None:
            return None
        contexts.append(n_ctx)
        busy += slot.get("is_processing") is True
    return SlotLayout(len(contexts), sum(contexts), busy)


def parse_props(data: Any) -> SlotLayout | None:
    """``/props`` JSON -> layout (no busy count); None when the fields are missing."""
    if not isinstance(data, dict):
        return None
    slots = _positive_int(data.get("total_slots"))
    settings = data.get("default_generation_settings")
    n_ctx = _positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    if slots is None or n_ctx is None:
        return None
    return SlotLayout(slots, slots * n_ctx)
