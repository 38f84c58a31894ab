"""LoRA adapter affinity: place an adapter's request where the adapter can run at once.

A vLLM engine runs at most ``--max-loras`` adapters in one batch (default 1). A request for an
adapter that is not among those running waits ("deferred" in
``vllm:num_requests_waiting_by_reason``) until every running request of another adapter has
finished and a slot frees, however idle the engine is otherwise; nothing in its queue or KV
state shows that wait to a TTFT prediction. So, as llm-d's LoRA affinity does, an adapter's
request is placed among the instances that can run it now: those where the adapter is active
(kvgate's own requests in flight there, or the engine's ``running_lora_adapters``) and those
with a free adapter slot. Where no instance can, every instance is a candidate and placement
decides as for any request. Instances whose slot count is unknown (no LoRA metrics) count as
free. Pure: the engine's state comes in from the gateway's scrapes (``engine_state``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from routing.instance_books import InstanceState
from routing.request_progress import RequestRecord


@dataclass(frozen=True, slots=True)
class EngineAdapters:
    """What an engine last said of its adapters (vLLM ``vllm:lora_requests_info``)."""

    max_loras: int
    running: frozenset[str] = frozenset()


class LoraAffinity:
    """Per instance, the engine's adapter slots; filters a pool for an adapter's request."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineAdapters] = {}

    def engine_state(self, instance_id: str, state: EngineAdapters | None) -> None:
        if state is None:
            self._engines.pop(instance_id, None)
        else:
            self._engines[instance_id] = state

    def slots(self, instance_id: str) -> EngineAdapters | None:
        return self._engines.get(instance_id)

    def candidates(
        self,
        lora: str,
        pool: list[InstanceState],
        in_flight: Iterable[RequestRecord],
    ) -> list[InstanceState]:
        """The instances of ``pool`` that can run ``lora`` without waiting for a slot; the
        whole pool if none can (or none has a known slot count)."""
        limited = [i for i in pool if i.id in self._engines]
        if not limited:
            return pool
        active = self._active({i.id for i in limited}, in_flight)
        ready = []
        for inst in pool:
            engine = self._engines.get(inst.id)
            if engine is None:
                ready.append(inst)
                continue
            on = active.get(inst.id, set()) | engine.running
            if lora in on or len(on) < engine.max_loras:
                ready.append(inst)
        return ready or pool

    @staticmethod
    def _active(ids: set[str], in_flight: Iterable[RequestRecord]) -> dict[str, set[str]]:
        """The adapters of kvgate's own requests in flight on each of ``ids`` (either leg)."""
        active: dict[str, set[str]] = {}
        for rec in in_flight:
            lora = rec.request.lora
            if lora is None:
                continue
            d = rec.decision
            for iid in {d.prefill, d.decode}:
                if iid in ids:
                    active.setdefault(iid, set()).add(lora)
        return active
