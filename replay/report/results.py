"""What one replay run produced: per-request outcomes and load samples.

The offline simulator and the live load generator both fill these, so one report module
(``replay.report.report``) summarises either. Times are seconds from the start of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Outcome(StrEnum):
    COMPLETED = "completed"
    REJECTED = "rejected"  # refused by admission before any GPU work
    REJECTED_AFTER_PREFILL = "rejected_after_prefill"  # refused by decode: wasted prefill
    FAILED = "failed"  # engine or transport error


@dataclass(slots=True)
class RequestOutcome:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # tokens asked for (trace output length)
    outcome: Outcome = Outcome.FAILED
    reason: str = ""  # rejection reason / error
    prefill_instance: str | None = None
    decode_instance: str | None = None
    cached_tokens: int = 0  # prompt tokens the engine did not recompute
    ttft_s: float | None = None
    finish_s: float | None = None
    generated: int = 0
    tbt_mean_s: float | None = None  # mean time between tokens of this request
    tbt_max_s: float | None = None
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None  # the decode forecast admission checked
    predicted_output_tokens: int | None = None
    transferred_bytes: float = 0.0  # prefix pulls for this request
    best_effort: bool = False  # admitted without the TTFT promise (routing/best_effort.py)

    def meets_slo(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        """Completed, first token within the TTFT SLO, mean TBT within the TBT SLO."""
        if self.outcome is not Outcome.COMPLETED or self.ttft_s is None:
            return False
        if self.ttft_s > ttft_slo_s:
            return False
        return self.tbt_mean_s is None or self.tbt_mean_s <= tbt_slo_s


@dataclass(slots=True)
class LoadSample:
    """One instance's load at one moment (Mooncake Figures 9-10 plot these over time)."""

    time_s: float
    instance: str
    role: str
    queued_prefills: int
    queue_s: float  # predicted/actual prefill backlog in seconds
    decode_batch: int
    tbt_s: float  # current decode step time (0 if idle)


@dataclass(slots=True)
class RunResult:
    label: str  # e.g. "kvcache_centric+predictive"
    policy: str
    admission: str
    ttft_slo_s: float
    tbt_slo_s: float
    duration_s: float  # trace span replayed (arrival of first to last request)
    wall_s: float = 0.0
    requests: list[RequestOutcome] = field(default_factory=list)
    load: list[LoadSample] = field(default_factory=list)
    # Token-level TBT distribution: (step seconds, tokens produced at that step time).
    tbt_steps: list[tuple[float, int]] = field(default_factory=list)
    transferred_bytes: float = 0.0  # prefix pulls + replication copies
    kv_transfer_bytes: float = 0.0  # prefill -> decode
    replication_commands: int = 0
    replicated_bytes: float = 0.0
    extra: dict[str, float | int | str] = field(default_factory=dict)
