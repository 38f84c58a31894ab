"""The seam every placement policy implements, and the context it is given."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from config.settings import AdmissionMode
from routing.admission import EffectiveSLO
from routing.estimates import PrefillOption, TTFTEstimator
from routing.instance_books import InstanceState
from routing.types import PrefixMatch, RequestInfo


@dataclass(slots=True)
class PlacementContext:
    """Everything a policy may look at for one request. Policies must not mutate it."""

    request: RequestInfo
    now: float
    match: PrefixMatch
    prefill_candidates: list[InstanceState]  # eligible, in registration order
    decode_candidates: list[InstanceState]  # eligible; empty for colocated pools
    estimator: TTFTEstimator
    rng: random.Random
    predicted_output: int
    block_size: int
    # The request's effective SLO (priority class and per-request overrides applied), for
    # policies whose placement rule is SLO-driven (rolling_activation's CheckConstraints).
    slo: EffectiveSLO | None = None
    # Where exact ties start (a gateway replica's rank, Conductor.rotate_ties): replicas
    # deciding at the same moment on the same books then pick different instances.
    tie_rotation: int = 0


class Policy(Protocol):
    """Chooses the prefill instance; may override the decode choice.

    ``select_decode`` returning None means "the Conductor's default": the decode instance with
    the lowest predicted TBT after adding the request (Mooncake's load-balancing decode).
    """

    name: ClassVar[str]
    # The admission the policy's real system ships with (used by `--compare` bare names).
    native_admission: ClassVar[AdmissionMode]
    # Whether the Conductor may move the decode when the prefill is done (routing.decode_rebind).
    # The peers' routers bind decode up front, so their re-implementations say no.
    late_decode_binding: ClassVar[bool]

    def select_prefill(self, ctx: PlacementContext) -> PrefillOption: ...

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None: ...

    def on_fleet_change(self, instances: list[InstanceState], now: float) -> None: ...


class PolicyBase:
    """Defaults shared by the policies: no decode override, no parameters."""

    name: ClassVar[str] = ""
    native_admission: ClassVar[AdmissionMode] = AdmissionMode.NONE
    late_decode_binding: ClassVar[bool] = True

    def __init__(self, **params: Any) -> None:
        if params:
            raise TypeError(f"unknown parameter(s) {sorted(params)}")

    def select_decode(self, ctx: PlacementContext) -> InstanceState | None:
        return None

    def on_fleet_change(self, instances: list[InstanceState], now: float) -> None:
        """The eligible colocated (role ``both``) instances changed: added, removed, drained,
        unhealthy or back; ``instances`` in registration order. Called by the Conductor on
        every pool refresh (and after a policy swap), so a policy that keeps per-instance
        state (e.g. rolling_activation's macro instances) can regroup eagerly. Requests are
        not the policy's business: the Conductor's books keep them. Default: nothing."""
        return None


def min_queue(candidates: list[InstanceState], now: float) -> InstanceState:
    best = candidates[0]
    best_q = best.queue_time(now)
    for inst in candidates[1:]:
        q = inst.queue_time(now)
        if q < best_q:
            best, best_q = inst, q
    return best
