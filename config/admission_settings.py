"""The typed ``[admission]`` section: the admission mode and what each part of admission keeps
(the peers' overload controls, best effort, the decode reservation, the learned TBT headroom).
Checked in config/checks.py; used by routing/admission.py and the modules it names."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class AdmissionMode(StrEnum):
    NONE = "none"
    EARLY = "early"
    PREDICTIVE = "predictive"
    # The overload control the placement policy's own system ships with (SMG limiter, GIE
    # saturation detector, Dynamo busy thresholds): routing/policies/peer_overload.py.
    PEER = "peer"


@dataclass(frozen=True, slots=True)
class PeerOverloadSettings:
    """Admission mode ``peer``: each peer's overload control, upstream defaults
    (docs/peer-fidelity.md cites the files). Only the section of the policy in use applies."""

    # SMG / sglang router limiter (smg main.rs): -1 = off (the shipped default).
    smg_max_concurrent_requests: int = -1
    smg_queue_size: int = 100
    smg_queue_timeout_s: float = 60.0
    # Token-bucket refill per second; None = max_concurrent_requests per second.
    smg_rate_limit_tokens_per_second: float | None = None
    # GIE utilization saturation detector + shedding of sheddable (priority < 0) requests.
    gie_queue_depth_threshold: float = 5.0
    gie_kv_cache_util_threshold: float = 0.8
    gie_metrics_staleness_s: float = 0.2
    # Scrape interval of the simulated metrics (GIE data layer; llm-d guides use 50 ms).
    gie_scrape_interval_s: float = 0.05
    # Whether traffic is sheddable (InferenceObjective priority < 0): GIE never sheds
    # non-sheddable requests, so with False the detector admits everything.
    gie_sheddable: bool = True
    # "saturation" (hard shed at pool saturation >= 1) or "probabilistic" (llm-d admitter:
    # p = min(300 * saturation^5, 1)).
    gie_admitter: str = "saturation"
    # Dynamo busy thresholds (v1.1.1 defaults): reject (529) when every worker of a pool is busy.
    dynamo_active_decode_blocks_threshold: float = 1.0
    dynamo_active_prefill_tokens_threshold_frac: float = 10.0
    # The engines' max_num_batched_tokens the prefill fraction refers to (vLLM V1 default).
    dynamo_max_num_batched_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class BestEffortSettings:
    """Serve late, rather than reject, a prompt no instance could serve within the TTFT SLO
    even idle, when it only takes capacity nobody else is using (its instance has nothing
    booked, this share of the prefill pool is idle, decode has room). routing/best_effort.py;
    measured in docs/experiments.md §2.3."""

    enabled: bool = True
    # Share of the model's prefill pool that must have nothing booked at the decision.
    idle_share: float = 0.5
    # The TBT its decode instance is checked at, as a share of the TBT limit, at most.
    max_decode_load: float = 0.8


@dataclass(frozen=True, slots=True)
class DoomedWarmupSettings:
    """Warm the prompt of a request turned away because even an idle instance would miss its
    TTFT SLO (a "doomed" one, not served best effort) on a prefill instance with nothing
    booked, when at least ``min_idle`` of the prefill pool have nothing booked and its decode
    would have had room: the requests that later share its prefix find it cached instead of
    being doomed in turn. routing/doomed_warmup.py; measured in docs/experiments.md §2.3."""

    enabled: bool = True
    # Prefill instances with nothing booked at the decision, the one warmed included (the
    # whole pool where it is smaller).
    min_idle: int = 3
    # The TBT its decode instance is checked at, as a share of its TBT limit (its decode
    # reservation taken off), at most: where decode binds, the longer contexts its prefix
    # lets in would take the room of shorter ones.
    max_decode_load: float = 0.9


@dataclass(frozen=True, slots=True)
class DecodeQueueSettings:
    """A request turned away on its TBT check waits at the gateway for decode room, up to
    ``max_wait_share`` of its TTFT SLO and at most ``max_wait_s``; each finished decode
    admits the parked request with the shortest prompt that now passes both checks (within
    the TTFT budget it has left), of the ``tries`` shortest. routing/decode_queue.py;
    measured in docs/experiments.md §2.3."""

    enabled: bool = True
    max_wait_share: float = 0.9
    max_wait_s: float = 30.0
    max_parked: int = 1024
    tries: int = 8


@dataclass(frozen=True, slots=True)
class DecodeReservationSettings:
    """Under decode overload, keep the last ``fraction`` of the TBT limit for shorter prompts
    (trunk reservation; routing/decode_reservation.py; measured in docs/experiments.md §2.3)."""

    enabled: bool = True
    # Share of the TBT limit the longest prompts may not use (graded by prompt-length rank).
    fraction: float = 0.15
    # Prompts shorter than this quantile of the recent ones keep the whole limit.
    from_quantile: float = 0.6
    # How many recent prompts the rank is taken over.
    window: int = 1000
    # The starvation floor: prompts at least this long keep at least this share of the
    # overall admitted share (over ``window``); below it the reserve is waived for them.
    min_admit_ratio: float = 0.1
    # On only while at least this share of the recent shorter prompts (those that keep the
    # whole limit) failed the plain TBT check: the ones the reserve is for are turned away ...
    min_pressure: float = 0.1
    # ... counted over this many of them.
    pressure_window: int = 200


@dataclass(frozen=True, slots=True)
class TBTHeadroomSettings:
    """How much of the classes' TBT headroom is kept, learned from the decodes' outcomes
    (routing/tbt_headroom.py; measured in docs/experiments.md §2.3). Over each ``window``
    finished decodes of a model: a share of misses (mean TBT over the SLO, or refused by the
    decode engine) above ``target_miss`` raises the kept share by ``raise_step``, one below
    half of it lowers the share by ``lower_step``, within [``min_share``, 1]. Starts at 1."""

    adaptive: bool = True
    target_miss: float = 0.005
    window: int = 200
    raise_step: float = 0.25
    lower_step: float = 0.1
    min_share: float = 0.0


@dataclass(frozen=True, slots=True)
class WaitMarginSettings:
    """A factor on the predicted queue wait, learned from the admitted requests' first
    tokens (routing/wait_margin.py; measured in docs/real-engines.md). Over each ``window``
    of them, per served model: a share over the TTFT SLO above ``target_miss`` multiplies the
    factor by 1 + ``raise_gain`` x that share; one under half the target lowers it by
    ``lower_step``; within [1, ``max_factor``]. Starts at 1."""

    adaptive: bool = True
    target_miss: float = 0.01
    window: int = 50
    raise_gain: float = 2.0
    lower_step: float = 0.05
    max_factor: float = 4.0


@dataclass(frozen=True, slots=True)
class PrefillStallSettings:
    """The TBT check of a request placed on a colocated instance also asks what its prefill
    does to the decodes already there (routing/prefill_stall.py), counting on ``credit`` of
    their future TBT slack (routing/stall_credit.py; measured in docs/experiments.md §2.7).
    With ``adaptive``, over each ``window`` finished decodes of a model's colocated
    instances, a share over the TBT SLO for the prefills they sat through (without those
    they would have met it) above ``target_miss`` multiplies the credit by
    ``lower_factor`` and one under half of it adds ``raise_step``, within [0, ``max_credit``];
    it starts at ``credit``."""

    enabled: bool = True
    credit: float = 0.1
    adaptive: bool = True
    target_miss: float = 0.005
    window: int = 50
    raise_step: float = 0.01
    lower_factor: float = 0.75
    max_credit: float = 1.0


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    mode: AdmissionMode = AdmissionMode.PREDICTIVE
    peer: PeerOverloadSettings = field(default_factory=PeerOverloadSettings)
    best_effort: BestEffortSettings = field(default_factory=BestEffortSettings)
    doomed_warmup: DoomedWarmupSettings = field(default_factory=DoomedWarmupSettings)
    decode_reservation: DecodeReservationSettings = field(default_factory=DecodeReservationSettings)
    decode_queue: DecodeQueueSettings = field(default_factory=DecodeQueueSettings)
    tbt_headroom: TBTHeadroomSettings = field(default_factory=TBTHeadroomSettings)
    wait_margin: WaitMarginSettings = field(default_factory=WaitMarginSettings)
    prefill_stall: PrefillStallSettings = field(default_factory=PrefillStallSettings)
    # Predictions are multiplied by these before the SLO comparison (>1 = conservative).
    ttft_margin: float = 1.0
    tbt_margin: float = 1.0
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 60.0
