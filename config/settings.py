"""Typed, frozen settings for kvgate.

Every section is a frozen dataclass. Values are validated once by ``config.loader`` (which names
the offending key path and file) and never change afterwards; live changes through the admin API
build a new ``Settings`` with ``dataclasses.replace`` and validate it the same way.
Units are in the field names: ``_s`` seconds, ``_ms`` milliseconds, ``_gbps`` gigabits/s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class Protocol(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    OPENAI = "openai"


class AdmissionMode(StrEnum):
    NONE = "none"
    EARLY = "early"
    PREDICTIVE = "predictive"


class DecodePlacement(StrEnum):
    COMMITTED = "committed"
    CURRENT = "current"


class ReplicationSink(StrEnum):
    DRY_RUN = "dry_run"
    ENGINE = "engine"
    MOONCAKE_STORE = "mooncake_store"


def frozen_mapping(data: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """A priority class. Higher ``level`` is more important.

    ``headroom`` is the fraction of the SLO a request of this class must leave unused to be
    admitted: lower classes keep headroom for higher ones and so are shed first.
    ``ttft_s``/``tbt_s`` override the global SLO for the class when set.
    """

    name: str
    level: int
    headroom: float = 0.0
    ttft_s: float | None = None
    tbt_s: float | None = None


def _default_priorities() -> tuple[PriorityClass, ...]:
    return (
        PriorityClass(name="high", level=2, headroom=0.0),
        PriorityClass(name="normal", level=1, headroom=0.1),
        PriorityClass(name="low", level=0, headroom=0.3),
    )


@dataclass(frozen=True, slots=True)
class SLOSettings:
    ttft_s: float = 30.0
    tbt_s: float = 0.1
    priorities: tuple[PriorityClass, ...] = field(default_factory=_default_priorities)
    default_priority: str = "normal"
    # Operator limits for per-request overrides (x-slo-ttft-ms / x-slo-tbt-ms): clamped into range.
    min_ttft_s: float = 0.05
    max_ttft_s: float = 120.0
    min_tbt_s: float = 0.005
    max_tbt_s: float = 1.0

    def priority(self, name: str) -> PriorityClass:
        for p in self.priorities:
            if p.name == name:
                return p
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    policy: str = "kvcache_centric"
    # Policy-specific parameters, validated by the policy's own Params dataclass.
    params: Mapping[str, Any] = field(default_factory=frozen_mapping)
    block_size: int = 16
    # Algorithm 1: pull the best holder's prefix when best_len / local_len >= this ratio.
    kvcache_balancing_threshold: float = 1.5
    # Smallest remote prefix (in blocks) worth a transfer or a replication.
    min_transfer_blocks: int = 4
    # Predict-on-route entries expire unless an engine KV event confirms them; None = never.
    predict_on_route_ttl_s: float | None = None
    # Decode placement key: "committed" = TBT with everything already assigned to the
    # instance (running + still in prefill); "current" = TBT of the running batch only
    # (Mooncake's load balancing; herds requests onto instances whose newcomers are in prefill).
    decode_placement: DecodePlacement = DecodePlacement.COMMITTED
    tokenizer_file: str | None = None
    chars_per_token: float = 4.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    mode: AdmissionMode = AdmissionMode.PREDICTIVE
    # Predictions are multiplied by these before the SLO comparison (>1 = conservative).
    ttft_margin: float = 1.0
    tbt_margin: float = 1.0
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 60.0


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    profile: str = "llama3-8b-h100-tp1"
    # A learned prefill model saved by `kvgate predictors train`; None = analytic prior.
    prefill_model_file: str | None = None
    # Per-step engine overhead added to the GPU-time model (calibration README section 5).
    overhead_ms: float = 0.5
    # Network between instances (KV transfer prefill->decode and prefix pulls).
    link_bandwidth_gbps: float = 200.0
    # Loading cached KV from host memory (HiCache L2) and from the shared store (L3).
    host_load_gbps: float = 200.0
    store_load_gbps: float = 100.0
    # Output length: history per prefix key, fallback quantile of all observations.
    output_length_history: int = 64
    output_length_quantile: float = 0.5
    default_output_tokens: int = 256


@dataclass(frozen=True, slots=True)
class InstanceSettings:
    id: str
    url: str
    role: Role
    protocol: Protocol = Protocol.VLLM
    profile: str | None = None  # None = predictors.profile
    capacity_tokens: int | None = None  # GPU KV capacity; None = the profile's
    host_capacity_tokens: int = 0  # HiCache-style host tier; 0 = none
    max_batch: int = 256
    bootstrap_port: int | None = None  # SGLang P/D
    kv_events_endpoint: str | None = None  # vLLM ZMQ publisher, e.g. tcp://127.0.0.1:5557


@dataclass(frozen=True, slots=True)
class PoolSettings:
    name: str
    role: Role
    instances: tuple[InstanceSettings, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicationSettings:
    enabled: bool = True
    sink: ReplicationSink = ReplicationSink.DRY_RUN
    # A prefix is hot when its decayed access rate (requests/s) reaches this.
    hot_rate_per_s: float = 0.5
    rate_half_life_s: float = 30.0
    min_prefix_blocks: int = 4
    # Proactive replication when every holder's predicted queue exceeds this.
    holder_queue_threshold_s: float = 2.0
    max_replicas: int = 4
    max_in_flight: int = 8
    max_in_flight_per_destination: int = 2
    cooldown_s: float = 10.0
    max_retries: int = 2
    timeout_s: float = 30.0
    # Mooncake Store sink: the master's RPC address and instance id -> store segment name
    # (an instance missing here uses its id as the segment name).
    store_master_addr: str = "127.0.0.1:50051"
    store_segments: Mapping[str, Any] = field(default_factory=frozen_mapping)


class TracingExporter(StrEnum):
    OFF = "off"
    CONSOLE = "console"
    OTLP = "otlp"


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    # Admin API bearer token; None disables the admin API (no default token works).
    admin_token: str | None = None
    # Retries on another instance, only while nothing has reached the client yet.
    max_retries: int = 1
    health_interval_s: float = 2.0
    scrape_interval_s: float = 1.0
    # Observed prefill timings refit the prefill predictor this often (0 = never).
    refit_interval_s: float = 60.0
    refit_min_samples: int = 200
    recent_decisions: int = 1000  # kept for /admin/decisions and predictor accuracy
    max_body_bytes: int = 16 * 1024 * 1024
    tracing: TracingExporter = TracingExporter.OFF
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces


@dataclass(frozen=True, slots=True)
class Settings:
    slo: SLOSettings = field(default_factory=SLOSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    predictors: PredictorSettings = field(default_factory=PredictorSettings)
    pools: tuple[PoolSettings, ...] = ()
    replication: ReplicationSettings = field(default_factory=ReplicationSettings)
    server: ServerSettings = field(default_factory=ServerSettings)

    def instances(self) -> tuple[InstanceSettings, ...]:
        return tuple(i for p in self.pools for i in p.instances)
