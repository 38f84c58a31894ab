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

# AdmissionMode is re-exported: the admission mode is named wherever settings are.
from config.admission_settings import AdmissionMode as AdmissionMode
from config.admission_settings import AdmissionSettings
from config.model_settings import ModelSettings
from config.replica_settings import ReplicasSettings
from config.tenant_settings import TenantsSettings


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class PDProtocol(StrEnum):
    """How kvgate talks to an instance's engine, its P/D legs included: vLLM's protocol,
    SGLang's bootstrap handshake, or a plain OpenAI-compatible server. (Not ``Protocol``:
    that name is typing's, and the seams use it.)"""

    VLLM = "vllm"
    SGLANG = "sglang"
    OPENAI = "openai"


class EngineKind(StrEnum):
    """Which engine serves an instance: how its /metrics are read and its answers understood.
    ``auto`` detects it from the metric names; ``openai`` is a server without /metrics."""

    AUTO = "auto"
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    OPENAI = "openai"


class KVConnector(StrEnum):
    """How a vLLM prefill/decode pair moves KV, i.e. what the gateway must send each leg.

    - ``nixl``: the decode pulls KV from the prefill (vLLM's NixlConnector; also MoRIIO in read
      mode): the prefill leg asks for ``do_remote_decode`` and its answer's
      ``kv_transfer_params`` go to the decode leg.
    - ``shared_storage``: both engines reach one KV store and the decode finds the prompt's KV
      by its tokens (vLLM's ExampleConnector, LMCacheConnectorV1 with a shared backend): a
      one-token prefill leg, then the original request to the decode, no parameters.
    vLLM's MooncakeConnector needs gateway-minted ``transfer_id``/``remote_bootstrap_addr``
    and P2pNcclConnector encoded request ids: neither is supported yet.
    """

    NIXL = "nixl"
    SHARED_STORAGE = "shared_storage"


class DecodePlacement(StrEnum):
    COMMITTED = "committed"
    CURRENT = "current"


class ReplicationSink(StrEnum):
    DRY_RUN = "dry_run"
    ENGINE = "engine"  # the engine pulls the blocks (/internal/kv/fetch: kvgate's emulator)
    MOONCAKE_STORE = "mooncake_store"
    WARMUP = "warmup"  # a one-token prefill of the prefix on the destination (any engine)
    # The same, through the store the engines' own KV connector shares (vLLM's ExampleConnector
    # directory, LMCacheConnectorV1 with a shared backend): the source writes the prefix to it,
    # the destination loads it from there instead of computing it.
    CONNECTOR_STORE = "connector_store"


def frozen_mapping(data: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(data or {}))


# How long kvgate's HTTP servers (serve, epp, pd-sidecar) keep an idle client connection:
# ``ServerSettings.keep_alive_s`` says why.
KEEP_ALIVE_S = 75.0


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """A priority class. Higher ``level`` is more important.

    ``headroom`` is the fraction of the SLO a request of this class must leave unused to be
    admitted: lower classes keep headroom for higher ones and so are shed first.
    ``tbt_headroom`` is the same for the TBT SLO alone (None = ``headroom``); the share of it
    in force adapts to the decodes' outcomes (``admission.tbt_headroom``).
    ``ttft_s``/``tbt_s`` override the global SLO for the class when set.
    """

    name: str
    level: int
    headroom: float = 0.0
    ttft_s: float | None = None
    tbt_s: float | None = None
    tbt_headroom: float | None = None

    @property
    def tbt_keep(self) -> float:
        """The TBT headroom this class keeps."""
        return self.headroom if self.tbt_headroom is None else self.tbt_headroom


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
    # Policy-specific parameters: keyword arguments of the policy's constructor, checked by name
    # and type when the policy is built (routing/policies/registry.py).
    params: Mapping[str, Any] = field(default_factory=frozen_mapping)
    block_size: int = 16
    # Algorithm 1: pull the best holder's prefix when best_len / local_len >= this ratio.
    kvcache_balancing_threshold: float = 1.5
    # Smallest remote prefix (in blocks) worth a transfer or a replication.
    min_transfer_blocks: int = 4
    # Predict-on-route entries expire unless the engine confirms them (a KV event, or its
    # answer: a completed request's prompt is cached); None = never. 120 s outlasts the
    # time a request normally takes to be answered (the default TTFT SLO is 30 s, the
    # longest a client may ask for 120 s), so only beliefs nobody confirmed lapse.
    predict_on_route_ttl_s: float | None = 120.0
    # Decode placement key: "committed" = TBT with everything already assigned to the
    # instance (running + still in prefill); "current" = TBT of the running batch only
    # (Mooncake's load balancing; herds requests onto instances whose newcomers are in prefill).
    decode_placement: DecodePlacement = DecodePlacement.COMMITTED
    # Conditional disaggregation: prefill on the chosen decode instance (no KV transfer) when
    # the predictors say that beats the prefill pool (routing/conditional_disagg.py). Off:
    # it did not raise goodput in the sweeps (docs/experiments.md §2.3).
    conditional_disagg: bool = False
    # Late decode binding: when a prefill finishes and its decode instance can no longer take
    # the request within the TBT SLO (others joined, predicted departures did not happen),
    # its decode goes to an instance that can (routing/decode_placement.py ``rebind_target``).
    # Only where the KV leaves the prefill instance after the prefill (vLLM's P/D, the
    # simulator); SGLang's bootstrap binds both legs up front.
    decode_rebind: bool = True
    # Hugging Face model directory (tokenizer.json + chat template): the engine's own prompt
    # tokens (backends/model_files.py). None = tokenizer_file, else the approximate tokenizer.
    model_dir: str | None = None
    tokenizer_file: str | None = None
    # Without a ``models`` table: the ``model`` names that are LoRA adapters of the one model
    # (with one, each model lists its own: ``models[].lora_adapters``).
    lora_adapters: tuple[str, ...] = ()
    # An adapter's request goes where the adapter can run at once (active, or a free adapter
    # slot per the engine's metrics): routing/lora_affinity.py.
    lora_affinity: bool = True
    # With lora_affinity: an instance that does not hold the adapter in host memory (by
    # kvgate's book of what ran there: routing/adapter_loads.py) is charged its load in the
    # predicted TTFT. How many adapters an engine holds (vLLM --max-cpu-loras; 0 = its
    # --max-loras, vLLM's default) and the load time (None = learned from first tokens).
    lora_cpu_adapters: int = 0
    lora_load_s: float | None = None
    chars_per_token: float = 4.0
    # With model_dir: a prompt with at least this many characters left to tokenize (not in
    # the segment cache) is tokenized in a worker thread, off the event loop; 0 = never.
    tokenize_offload_chars: int = 8192
    # With model_dir: a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen 2 ...) runs on tiktoken
    # for the text between added tokens, the same ids at ~1/3 of the CPU; checked against the
    # tokenizers library on probe texts at start-up (backends/fast_bpe.py). False: tokenizers only.
    tiktoken: bool = True
    # With model_dir: a chat whose shape (roles, empty texts, tool calls, kwargs, the tools
    # offered) was rendered before is spliced from that rendering's skeleton instead of running
    # the template again, where the template only copies, trims or JSON-encodes the texts and
    # arguments; checked against the template on each new shape and every 64th request after
    # (routing/chat_skeleton.py). False: always the template.
    template_skeletons: bool = True
    seed: int = 0
    # llama.cpp instances: pin each request to the slot (``id_slot``) that holds its longest
    # prefix, waiting behind at most this many queued requests before taking another slot
    # (routing/llamacpp_slots.py); off = llama-server picks, and thrashes hot prefixes.
    # 3, not 1: waiting for the slot beat spilling into (and evicting) another one on real
    # llama-servers, 6 and 8 prompts (docs/real-engines.md section 3).
    llamacpp_slot_affinity: bool = True
    llamacpp_slot_max_waiting: int = 3
    # Ask each llama-server once (slots + 2 one-token requests) whether it keeps a host prompt
    # cache (--cache-ram, on by default in llama-server); one that does is never pinned: its
    # slots are not its cache (gateway/host_cache_probes.py). false = assume --cache-ram 0.
    llamacpp_host_cache_probe: bool = True
    # Placement charges a llama.cpp option this many times the recompute of the shared prefix
    # it would overwrite in an idle slot (the next request for that prefix pays it); ranking
    # only, never a predicted TTFT. 0 = off: the least TTFT alone, which spills a hot prompt's
    # repeats into other engines' slots (docs/real-engines.md section 3).
    llamacpp_evict_weight: float = 1.0
    # The directory the llama-servers were started with as ``--slot-save-path`` (all of them,
    # and kvgate must see it: one host or a shared filesystem). Set, a slot's shared prefix is
    # saved there once and loaded back into whichever slot a later request for it gets, instead
    # of recomputed (gateway/slot_files.py); at most llamacpp_slot_files_max files, the least
    # recently used deleted; a gateway that starts on files an earlier one saved takes them
    # over. None = off.
    llamacpp_slot_save_path: str | None = None
    llamacpp_slot_files_max: int = 32


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    profile: str = "llama3-8b-h100-tp1"
    # A learned prefill model saved by `kvgate predictors train`; None = analytic prior.
    prefill_model_file: str | None = None
    # A profile measured on your own engine by `kvgate profile` (JSON); replaces `profile` for
    # every instance without its own, and answers to its name in `instances[].profile`.
    profile_file: str | None = None
    # More measured profiles (one per engine kind or model), each chosen by its name in
    # `instances[].profile` or `models[].profile`.
    profile_files: tuple[str, ...] = ()
    # Per-step engine overhead added to the GPU-time model (calibration README section 5).
    overhead_ms: float = 0.5
    # Network between instances (KV transfer prefill->decode and prefix pulls).
    link_bandwidth_gbps: float = 200.0
    # Loading cached KV from host memory (HiCache L2, LMCache's CPU tier); None = the profile
    # GPU's host link (predictors/transfer.py HOST_LINK_GBPS: measured on an H200).
    host_load_gbps: float | None = None
    # ... and from the shared store (L3).
    store_load_gbps: float = 100.0
    # Output length: history per prefix key, fallback quantile of all observations.
    output_length_history: int = 64
    output_length_quantile: float = 0.5
    default_output_tokens: int = 256
    # Learn each colocated instance's queue-wait error from its answers (predictors/
    # queue_scale.py): the weight of one answer; 0 = trust the books as they are.
    queue_scale_rate: float = 0.05


@dataclass(frozen=True, slots=True)
class InstanceSettings:
    id: str
    url: str
    role: Role
    protocol: PDProtocol = PDProtocol.VLLM
    profile: str | None = None  # None = predictors.profile
    capacity_tokens: int | None = None  # GPU KV capacity; None = the profile's
    host_capacity_tokens: int = 0  # HiCache-style host tier; 0 = none
    # Most sequences the engine runs at once (llama.cpp slots, vLLM max_num_seqs); None = what
    # llama.cpp's /slots says, else the profile's (a measured profile has the engine's own).
    max_batch: int | None = None
    bootstrap_port: int | None = None  # SGLang P/D
    # The engine's own --kv-events-config endpoint: tcp://*:5557 (the engine binds; kvgate
    # connects to the url's host), ipc:///path.sock, or tcp://host:5557 (the engine connects;
    # kvgate binds host:5557).
    kv_events_endpoint: str | None = None
    kv_events_bind: bool | None = None  # force kvgate's side: true = bind, false = connect
    # The engine's replay ROUTER (vLLM: ``replay_endpoint`` in --kv-events-config, e.g.
    # tcp://*:5558): fills sequence gaps, and a gateway that (re)starts catches up from it.
    kv_events_replay_endpoint: str | None = None
    engine: EngineKind = EngineKind.AUTO  # metrics flavour (and llama.cpp's /slots)
    # Served model name; filled from the pool (models[].pools) when the config has models.
    model: str | None = None
    # vLLM P/D KV connector style; inherited from the pool; None = nixl for vLLM P/D.
    kv_connector: KVConnector | None = None
    # `kvgate epp` with P/D pools: the decode-side sidecar in front of this decode instance
    # (`kvgate pd-sidecar`, or llm-d's pd-sidecar); Envoy sends the instance's requests there.
    sidecar_url: str | None = None


@dataclass(frozen=True, slots=True)
class PoolSettings:
    name: str
    role: Role
    instances: tuple[InstanceSettings, ...] = ()
    model: str | None = None  # filled from models[].pools; instances inherit it
    kv_connector: KVConnector | None = None  # vLLM P/D pools; instances inherit it
    # How copies *into* this pool's instances are made; None = replication.sink.
    replication_sink: ReplicationSink | None = None


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
    # Warm-up sink: send the prefill only while the destination's predicted queue is below
    # this; token ids of recent prompts kept to rebuild prefixes from (bytes).
    warmup_max_queue_s: float = 0.5
    warmup_prefix_bytes: int = 64 * 1024 * 1024


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
    # A /health probe that takes longer counts as one failure (three in a row eject); a busy
    # engine (vLLM on CPU under load) answers late but is alive. A refused connection ejects
    # at once, whatever this says.
    health_timeout_s: float = 5.0
    # An ejected instance is probed this often (at most every health_interval_s) and rejoins
    # after two passes in a row: an engine back from a stall (a NIXL read held for a 30 s lease
    # on vLLM CPU) is routed to again within seconds.
    health_recheck_s: float = 1.0
    # An engine that accepted a request and then sends no byte for
    # clamp(max(silence_predicted_factor x predicted TTFT, silence_slo_factor x TTFT SLO),
    # silence_min_s, silence_max_s) seconds is aborted: 504 (or an SSE error event once the
    # stream has started), and its circuit breaker counts the failure. A non-streamed answer
    # adds the same multiples of max_tokens x TBT (predicted, SLO): it arrives all at once.
    silence_predicted_factor: float = 4.0
    silence_slo_factor: float = 3.0
    silence_min_s: float = 30.0
    silence_max_s: float = 300.0
    # SIGTERM: new requests get 503 + Retry-After; in-flight answers may finish for this long,
    # then the rest end with a clean error and the process exits 0.
    drain_timeout_s: float = 30.0
    # An idle client connection stays open this long (uvicorn's own default is 5 s). Longer than
    # the idle timeout of what sits in front (load balancers: often 60 s; httpx, the openai SDK:
    # 5 s), so that the client side closes first: a request sent just as the server closes its
    # connection is reset and lost, which no client retries safely.
    keep_alive_s: float = KEEP_ALIVE_S
    scrape_interval_s: float = 1.0
    # The port opens once the engines' metrics were read once and every llama.cpp engine said
    # whether it keeps a host prompt cache, or after this long (0: at once).
    startup_wait_s: float = 3.0
    # Observed prefill timings refit the prefill predictor this often (0 = never).
    refit_interval_s: float = 60.0
    refit_min_samples: int = 200  # observations (+ a measured profile's sweep) for LightGBM
    # Fewer new observations than this since the last refit: no refit. Between this and
    # refit_min_samples the refit fits the analytic prefill form (3 coefficients) instead.
    refit_min_new_samples: int = 20
    # A refit trains on the newest this many observations per profile (+ a measured profile's
    # sweep): recent behaviour counts, and the learner's memory and a refit's cost stop growing
    # once it is full (LightGBM's fit on 4,000 rows: ~60 ms in a worker thread).
    refit_window: int = 4000
    recent_decisions: int = 1000  # kept for /admin/decisions and predictor accuracy
    max_body_bytes: int = 16 * 1024 * 1024
    # A completion whose ``prompt`` is a list of prompts is served as one request per prompt
    # (gateway/batched_prompts.py); more prompts than this in one request: 400.
    max_batch_prompts: int = 1024
    tracing: TracingExporter = TracingExporter.OFF
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces


@dataclass(frozen=True, slots=True)
class Settings:
    slo: SLOSettings = field(default_factory=SLOSettings)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    predictors: PredictorSettings = field(default_factory=PredictorSettings)
    pools: tuple[PoolSettings, ...] = ()
    # Served models (empty = one unnamed model served by every pool, as before).
    models: tuple[ModelSettings, ...] = ()
    replication: ReplicationSettings = field(default_factory=ReplicationSettings)
    server: ServerSettings = field(default_factory=ServerSettings)
    tenants: TenantsSettings = field(default_factory=TenantsSettings)
    replicas: ReplicasSettings = field(default_factory=ReplicasSettings)

    def instances(self) -> tuple[InstanceSettings, ...]:
        return tuple(i for p in self.pools for i in p.instances)

    def served_model(self, name: str) -> ModelSettings | None:
        """The model a request's ``model`` names (by name or alias); None if none does."""
        for m in self.models:
            if name in m.names():
                return m
        return None
