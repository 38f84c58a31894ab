"""Settings of one emulated engine instance (one process = one vLLM / SGLang server)."""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field
from typing import Literal

from config.settings import PDProtocol, Role
from predictors.profiles import EngineProfile, get_profile

KVEventsFormat = Literal["array", "map"]


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    role: Role = Role.BOTH
    protocol: PDProtocol = PDProtocol.VLLM  # vllm or sglang (the P/D protocol and metric names)
    profile: str = "llama3-8b-h100-tp1"
    host: str = "127.0.0.1"  # never all interfaces by default: the emulator has no auth
    port: int = 0  # 0 = an ephemeral port (RunningEmulator.port reports it)
    # Wall seconds per model second: 1.0 = real speed, 0.05 = 20x faster.
    time_scale: float = 1.0
    block_size: int = 16
    # ZMQ KV events: None = off, 0 = an ephemeral port (tests), else that port.
    kv_events_port: int | None = None
    kv_events_format: KVEventsFormat = "array"
    kv_events_topic: str = "kv-events"
    link_gbps: float = 200.0  # KV transfer link bandwidth, same default as the predictors
    link_latency_s: float = 0.0005  # replay.engine.network default
    decode_tbt_limit_ms: float | None = None  # Mooncake's decode-side TBT check; None = off
    model: str | None = None  # served model name; None = the profile name
    # More names it answers to (vLLM's --served-model-name takes several; the first is ``model``)
    model_aliases: tuple[str, ...] = ()
    bootstrap_port: int | None = None  # SGLang: extra port serving the bootstrap endpoint
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Engine model knobs; None = the same defaults replay.sim.fleet gives the simulator.
    chunk_tokens: int | None = None
    cache_capacity_tokens: int | None = None
    max_batch: int | None = None
    overhead_ms: float | None = None  # per-step overhead; None = the profile's
    # Wall-clock timeouts of the P/D protocols.
    pin_timeout_s: float = 480.0  # VLLM_NIXL_ABORT_REQUEST_TIMEOUT: pinned KV is freed after
    bootstrap_timeout_s: float = 300.0  # SGLang decode waiting for its prefill's room
    default_max_tokens: int = 16  # OpenAI completions default
    max_inflight: int = 4096  # requests held at once; more -> 503
    chars_per_token: float = 4.0  # ApproxTokenizer, same default as RoutingSettings
    # HF model directory: tokenize and render chat as the gateway with routing.model_dir does.
    model_dir: str | None = None
    hash_seed: int = 0  # BlockHasher seed, same default as RoutingSettings
    # LoRA adapters served, ``(name, path)`` as vLLM's ``--lora-modules name=path``: a request
    # naming one is keyed and published in the adapter's space (vLLM hashes the path too).
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # Adapters one batch runs at once (vLLM's --max-loras, default 1): a request for another
    # waits until a running adapter's last request has left.
    max_loras: int = 1
    # Adapters kept in host memory (vLLM's --max-cpu-loras; None: max_loras), and the time a
    # step takes longer to read in one that is not (0: loads are free).
    max_cpu_loras: int | None = None
    lora_load_s: float = 0.0

    def __post_init__(self) -> None:
        # argparse and TOML hand strings over; accept them for the enums.
        object.__setattr__(self, "role", Role(self.role))
        object.__setattr__(self, "protocol", PDProtocol(self.protocol))

    def validate(self) -> None:
        if self.protocol not in (PDProtocol.VLLM, PDProtocol.SGLANG):
            raise ValueError(f"protocol must be vllm or sglang, got {self.protocol.value}")
        get_profile(self.profile)  # KeyError naming the known profiles
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if not self.link_gbps > 0:
            raise ValueError("link_gbps must be > 0")
        if self.kv_events_format not in ("array", "map"):
            raise ValueError("kv_events_format must be 'array' or 'map'")
        if self.decode_tbt_limit_ms is not None and not self.decode_tbt_limit_ms > 0:
            raise ValueError("decode_tbt_limit_ms must be > 0")
        for name in ("port", "kv_events_port", "bootstrap_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535]")
        if self.default_max_tokens < 1 or self.max_inflight < 1 or self.max_loras < 1:
            raise ValueError("default_max_tokens, max_inflight and max_loras must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras (as vLLM requires)")
        if self.lora_load_s < 0:
            raise ValueError("lora_load_s must be >= 0")
        names = [name for name, _ in self.lora_adapters]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ValueError("LoRA adapter names must be non-empty and unique")
        if set(names) & set(self.served_names):
            raise ValueError("a LoRA adapter may not have a served model's name")

    @property
    def engine_profile(self) -> EngineProfile:
        return get_profile(self.profile)

    @property
    def advertised_host(self) -> str:
        """The host peers reach this instance at (kv_transfer_params' remote_host)."""
        if self.host in ("", "0.0.0.0", "::"):  # a wildcard bind names no reachable host
            return socket.gethostname()
        return self.host

    @property
    def served_model(self) -> str:
        return self.model or self.profile

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every base-model name a request may use (``/v1/models`` lists each)."""
        return (self.served_model, *self.model_aliases)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8
