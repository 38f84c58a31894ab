"""The Conductor's side of the decode queue (routing/decode_queue.py): which rejections may
wait, and which waiting request a finished decode admits.

The driver (gateway/decode_waits.py, the simulator) holds a client whose request ``park``
took; after each finished decode it asks ``release_parked`` for the one to admit now (a
``Decision`` it dispatches like any other) and ``expire_parked`` for those whose wait is over
(their 429 goes out then). A mixin of the Conductor (routing/conductor.py), which owns the
state named below; time is an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from routing.admission import SLO_MODES, Admission, EffectiveSLO
from routing.decode_queue import DecodeQueue
from routing.fleet_pools import ModelPools
from routing.types import Decision, Rejection, RejectReason, RequestInfo


class _Schedule(Protocol):
    def __call__(
        self, req: RequestInfo, now: float, exclude: frozenset[str] = ..., parked: bool = ...
    ) -> Decision | Rejection: ...


class ParkedRequests:
    """Decode-queue callbacks over the Conductor's state (declared here for the type checker)."""

    admission: Admission
    instances: dict[str, Any]
    decode_queue: DecodeQueue
    schedule: _Schedule
    effective_slo: Callable[[RequestInfo], EffectiveSLO]
    _pools_for: Callable[[RequestInfo], ModelPools]

    def park(self, rejection: Rejection, req: RequestInfo, now: float) -> bool:
        """Whether ``req``, just turned away on its TBT check, waits in the decode queue (the
        driver then holds its client); its TTFT keeps counting from ``now``. Not one whose
        decode would miss the check even alone in a batch: no finished decode can help it."""
        if (
            rejection.reason is not RejectReason.TBT_SLO
            or self.admission.mode not in SLO_MODES
            or rejection.warmup is not None
        ):
            return False
        slo = self.effective_slo(req)
        # One whose decode misses the TBT check even alone in a batch would wait for nothing.
        if not self._decode_takes(req, slo, today=False):
            return False
        return self.decode_queue.park(req, now, slo.ttft_s)

    def expire_parked(self, now: float) -> list[RequestInfo]:
        """The parked requests whose wait is over: the driver answers them 429 now."""
        return self.decode_queue.expire(now)

    def release_parked(self, now: float) -> tuple[RequestInfo, Decision] | None:
        """A decode finished: the parked request to admit now (shortest prompt first, the
        first that passes both checks within the TTFT budget it has left), or None. Its
        retries count nowhere (not as rejections, not in the reservation's windows)."""
        for entry in self.decode_queue.cheapest():
            left = entry.arrival_s + entry.ttft_slo_s - now
            if left <= 0:
                continue
            req = replace(entry.request, slo_ttft_s=left)
            slo = self.effective_slo(req)
            # Every check ``schedule`` makes is at least today's TBT on some decode instance:
            # where no batch takes it today, skip the whole decision (most releases, at overload).
            if not self._decode_takes(req, slo, today=True):
                continue
            out = self.schedule(req, now, parked=True)
            if isinstance(out, Decision) and self._fits_committed(req, slo, out):
                self.decode_queue.admit(entry.request.request_id)
                return entry.request, out
        return None

    def _decode_takes(self, req: RequestInfo, slo: EffectiveSLO, today: bool) -> bool:
        """Whether some instance that could decode ``req`` passes its TBT check with it: in
        its batch today, or (``today`` False) alone in a batch."""
        pools, p = self._pools_for(req), req.prompt_tokens
        return any(
            self.admission.tbt_passes(
                req, slo, i.tbt_now(1, p) if today else i.predictors.decode.step_time(1, p)
            )
            for i in pools.decode or pools.prefill
        )

    def _fits_committed(self, req: RequestInfo, slo: EffectiveSLO, d: Decision) -> bool:
        inst = self.instances.get(d.decode)
        if inst is None or d.decode == d.prefill:
            return True
        return self.admission.tbt_passes(req, slo, inst.committed_tbt(req.prompt_tokens))

    def unpark(self, request_id: str) -> None:
        """Its client stopped waiting."""
        self.decode_queue.drop(request_id)
