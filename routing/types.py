"""The data the scheduling core takes and returns. All times are seconds on the caller's clock.

Treat every record here as immutable. The three made for every request (``RequestInfo``,
``PrefixMatch``, ``Decision``) are nevertheless not ``frozen``: a frozen dataclass sets each
field through ``object.__setattr__``, which made building them ~10% of a decision's cost
(measured with callgrind, docs/proxy-bench.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum


class Tier(IntEnum):
    """Where a cached KV block lives (HiCache's L1 / L2 / L3)."""

    GPU = 0
    HOST = 1
    STORE = 2


@dataclass(slots=True)  # not frozen: per request, see the module docstring
class RequestInfo:
    request_id: str
    prompt_tokens: int
    block_hashes: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    priority: str | None = None  # class name; None = the configured default
    slo_ttft_s: float | None = None  # per-request override, clamped to operator limits
    slo_tbt_s: float | None = None
    # Key for the output-length predictor (e.g. hash of the shared system-prompt prefix).
    output_key: int | None = None
    # Served model (config ``models``): placed only on that model's instances. None = any.
    model: str | None = None
    lora: str | None = None  # the LoRA adapter it names (routing/lora_affinity.py)


# --- KV events (mirror vLLM's kv_events: BlockStored / BlockRemoved / AllBlocksCleared) ---


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)  # not frozen: per request, see the module docstring
class PrefixMatch:
    """Longest cached prefix of one prompt on every instance, from one pass over its blocks.

    Instances absent from the dicts hold no prefix of the prompt.
    """

    gpu_blocks: dict[str, int]  # consecutive leading blocks on GPU
    local_blocks: dict[str, int]  # consecutive leading blocks on GPU or host memory
    store_blocks: int  # consecutive leading blocks in the shared store
    best_blocks: int  # max(local_blocks)
    best_holders: tuple[str, ...]  # instances holding best_blocks (index order)

    def local(self, instance_id: str) -> int:
        return self.local_blocks.get(instance_id, 0)

    def gpu(self, instance_id: str) -> int:
        return self.gpu_blocks.get(instance_id, 0)


EMPTY_MATCH = PrefixMatch({}, {}, 0, 0, ())


class ReplicationReason(StrEnum):
    REACTIVE = "reactive"  # the request itself pulls the prefix from the holder (Algorithm 1)
    PROACTIVE = "proactive"  # a hot prefix whose holders are the bottleneck


@dataclass(frozen=True, slots=True)
class ReplicationCommand:
    command_id: str
    source: str  # instance id, or "store" for the shared store
    destination: str
    block_hashes: tuple[int, ...]
    tokens: int
    reason: ReplicationReason
    prefix_key: int  # hash of the last block of the replicated prefix
    issued_s: float
    request_id: str | None = None  # set when a request waits for this copy


@dataclass(slots=True)  # not frozen: per request, see the module docstring
class Decision:
    request_id: str
    prefill: str
    decode: str
    predicted_ttft_s: float
    predicted_tbt_s: float
    predicted_queue_s: float
    predicted_prefill_s: float
    predicted_transfer_s: float  # pull of a remote prefix before prefill (0 if none)
    predicted_load_s: float  # loading host / store tier blocks (0 if none)
    predicted_output_tokens: int
    cached_tokens: int  # prefix tokens the prefill will not recompute
    prompt_tokens: int
    policy: str
    reason: str
    priority: str
    slo_ttft_s: float
    slo_tbt_s: float
    replications: tuple[ReplicationCommand, ...] = ()
    pull_source: str | None = None  # holder the prefix is pulled from, if any
    best_effort: bool = False  # admitted without the TTFT promise (routing/best_effort.py)
    # The TBT admission checked, where it is not predicted_tbt_s: the forecast for when the
    # request gets there (predictive), the stall its prefill leaves on a colocated engine.
    checked_tbt_s: float | None = None
    # Pulls in flight to the prefill instance that carry prefix blocks this request counts
    # as cached there (another request's pull): its prefill starts after they land, or it
    # would recompute what it was predicted to reuse (HotspotPlanner.pulls_into).
    waits_for: tuple[str, ...] = ()
    # A warm-up: the prompt of a doomed request turned away, prefilled for the requests that
    # will share its prefix (routing/doomed_warmup.py); no decode leg, its answer is dropped.
    warmup: bool = False
    # Placed where its LoRA adapter was not in host memory (routing/adapter_loads.py): the
    # load charged, part of predicted_load_s (0.0 before one is learned); None: resident, or
    # no adapter.
    adapter_load_s: float | None = None


class RejectReason(StrEnum):
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    NO_HEALTHY_PREFILL = "no_healthy_prefill"
    NO_HEALTHY_DECODE = "no_healthy_decode"
    KV_CAPACITY = "kv_capacity"
    PROMPT_TOO_LONG = "prompt_too_long"
    PEER_OVERLOAD = "peer_overload"  # admission mode "peer": a peer router's own limiter


@dataclass(frozen=True, slots=True)
class Rejection:
    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    limit_s: float | None = None
    priority: str | None = None
    no_capacity: bool = False  # True -> 503 (nothing healthy), else 429
    # The warm-up of its prompt the caller may dispatch (Conductor.dispatched_warmup).
    warmup: Decision | None = None

    @property
    def http_status(self) -> int:
        return 503 if self.no_capacity else 429


@dataclass(slots=True)
class DecisionStats:
    """Counters the Conductor keeps for reports and metrics (mutable, owned by the Conductor)."""

    decisions: int = 0
    best_effort: int = 0  # decisions admitted best effort (also counted in ``decisions``)
    rejections: dict[str, int] = field(default_factory=dict)
    transfers: int = 0
    replications: int = 0
    rebinds: int = 0  # decodes moved when their prefill finished (late decode binding)
    tbt_moves: int = 0  # admitted off the planned decode instance, whose TBT check failed
    warmups: int = 0  # doomed requests' prompts warmed (routing/doomed_warmup.py)
