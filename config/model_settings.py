"""The typed ``[[models]]`` entries: the served models behind one gateway (checked in
config/fleet_checks.py, routed by gateway/models.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """One served model: the name clients send as ``model``, the pools that serve it, and what
    makes kvgate see its prompts and timings as its engines do. A request is only ever placed
    on its model's instances; each model hashes prompts in its own key space."""

    name: str
    pools: tuple[str, ...]
    # Other names clients may use for this model (e.g. the engines' --served-model-name).
    aliases: tuple[str, ...] = ()
    # Hugging Face model directory (tokenizer.json + chat template): engine-exact prompt tokens.
    model_dir: str | None = None
    tokenizer_file: str | None = None  # a bare tokenizer.json (no chat template)
    profile: str | None = None  # predictor profile of its instances (an instance's own wins)
    ttft_s: float | None = None  # SLO for this model's requests (None = slo.ttft_s)
    tbt_s: float | None = None
    # Served names of LoRA adapters on its engines (vLLM ``--lora-modules NAME=PATH``): a
    # request naming one goes to this model's pools, its blocks keyed in the adapter's space.
    lora_adapters: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases, *self.lora_adapters)
