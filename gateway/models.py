"""Served models at the gateway's edge: how each model's prompts become block keys.

With a ``models`` table every model brings its own prompt encoder (its tokenizer and chat
template, or the approximate fallback) and its own key space (a BlockHasher seeded with the
model's name), so equal token ids sent to two models never look like a shared prefix. Without
one, a single unnamed route serves every request, as before. A LoRA adapter (``models[].
lora_adapters``, or ``routing.lora_adapters`` without a table) is its base model's route with
the adapter's chain root: the engine never reuses the base model's KV for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import aiohttp

from backends.engine_models import fetch_served_models
from backends.model_files import make_prompt_encoder
from config.model_settings import ModelSettings
from config.settings import Settings
from routing.hashing import BlockHasher
from routing.prompt_encoder import PromptEncoder


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str | None  # the model's canonical name; None = the unnamed single model
    encoder: PromptEncoder
    hasher: BlockHasher
    # A LoRA adapter's name: the base model's encoder and pools, the adapter's key space
    # (vLLM keys an adapter's blocks apart from the base model's, and publishes them so).
    lora: str | None = None


def model_seed(name: str) -> int:
    """A stable 64-bit hasher seed per model name (BLAKE2b: equal across processes)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _route(settings: Settings, model: ModelSettings) -> ModelRoute:
    routing = settings.routing
    if model.model_dir or model.tokenizer_file:
        routing = replace(routing, model_dir=model.model_dir, tokenizer_file=model.tokenizer_file)
    hasher = BlockHasher(routing.block_size, seed=model_seed(model.name))
    return ModelRoute(model.name, make_prompt_encoder(routing), hasher)


def build_model_routes(
    settings: Settings,
) -> tuple[dict[str, ModelRoute], dict[str, ModelRoute]]:
    """``(by name or alias, by instance id)``; both empty without a ``models`` table."""
    by_name: dict[str, ModelRoute] = {}
    for model in settings.models:
        route = _route(settings, model)
        for name in model.names():
            by_name[name] = route
        for adapter in model.lora_adapters:
            by_name[adapter] = replace(route, lora=adapter)
    by_instance = {
        inst.id: by_name[inst.model] for inst in settings.instances() if inst.model in by_name
    }
    return by_name, by_instance


def adapter_routes(settings: Settings, default: ModelRoute) -> dict[str, ModelRoute]:
    """Without a ``models`` table: the single model's LoRA adapters (``routing.lora_adapters``)
    by name, each the unnamed route in the adapter's key space."""
    if settings.models:
        return {}
    return {name: replace(default, lora=name) for name in settings.routing.lora_adapters}


class ServedModels:
    """What ``/v1/models`` lists: the configured model names and aliases; without a
    ``models`` table, the engines' own, asked at most every ``refresh_s`` (clients poll
    /v1/models; the engines need not be asked each time)."""

    def __init__(
        self,
        settings: Callable[[], Settings],  # the gateway's current settings (reloads swap them)
        urls: Callable[[], Iterable[str]],  # the engines' base URLs, read live
        clock: Callable[[], float],
        refresh_s: float = 10.0,
    ) -> None:
        self._settings, self._urls, self._clock, self._refresh_s = settings, urls, clock, refresh_s
        self._engine_models: list[str] = []
        self._asked_at = float("-inf")

    async def ids(self, session: aiohttp.ClientSession | None) -> list[str]:
        settings = self._settings()
        if settings.models:
            return [n for m in settings.models for n in m.names()]
        now = self._clock()
        if session is not None and now - self._asked_at >= self._refresh_s:
            answered = await fetch_served_models(session, list(self._urls()))
            self._engine_models = answered or self._engine_models
            self._asked_at = now
        return list(self._engine_models)
