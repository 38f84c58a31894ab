"""LoRA adapter affinity: place an adapter's request where the adapter can run at once.

A vLLM engine runs at most ``--max-loras`` adapters in one batch (default 1). A request for an
adapter that is not among those running waits ("deferred" in
``vllm:num_requests_waiting_by_reason``) until every running request of another adapter has
finished and a slot frees, however idle the engine is otherwise; nothing in its queue or KV
state shows that wait to a TTFT prediction. So, as llm-d's LoRA affinity does, an adapter's
request is placed among the instances that can run it now: those where the adapter is active
(the engine's ``running_lora_adapters``, or kvgate's own requests in flight there while they
leave a slot for every adapter) and those with a free adapter slot. Where no instance can,
every instance is a candidate and placement decides as for any request. Instances whose slot
count is unknown (no LoRA metrics) count as free. Pure: the engine's state comes in from the
gateway's scrapes (``engine_state``).

vLLM 0.32 lists an adapter only once one of its requests has produced output (in both labels
of ``lora_requests_info``), so a request waiting for a slot shows in
``num_requests_waiting_by_reason{reason="deferred"}``, not in the list: kvgate's own requests
there stand for it.

Starvation: vLLM gives a waiting adapter a slot only once every request of a running one has
left, so a running adapter that keeps receiving requests would hold its slot forever. Where
kvgate's own requests hold more adapters than the engine has slots (one of them waits), the
running adapters get no more requests while another instance can take them: the waiting
adapter waits at most for the requests already running there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from routing.instance_books import InstanceState
from routing.types import Decision


@dataclass(frozen=True, slots=True)
class EngineAdapters:
    """What an engine last said of its adapters (vLLM ``vllm:lora_requests_info``)."""

    max_loras: int
    running: frozenset[str] = frozenset()


class LoraAffinity:
    """Per instance, the engine's adapter slots and the adapters of kvgate's own requests in
    flight there (counted as requests are placed, moved and finished: no scan per decision);
    filters a pool for an adapter's request."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineAdapters] = {}
        self._own: dict[str, Counter[str]] = {}  # instance -> adapter -> requests in flight
        self._placed: dict[str, tuple[str, frozenset[str]]] = {}  # request -> adapter, where

    def engine_state(self, instance_id: str, state: EngineAdapters | None) -> None:
        if state is None:
            self._engines.pop(instance_id, None)
        else:
            self._engines[instance_id] = state

    def slots(self, instance_id: str) -> EngineAdapters | None:
        return self._engines.get(instance_id)

    def placed(self, lora: str, decision: Decision) -> None:
        """An adapter's request is (now) on ``decision``'s instances (either leg)."""
        self.left(decision.request_id)
        where = frozenset((decision.prefill, decision.decode))
        self._placed[decision.request_id] = (lora, where)
        for iid in where:
            self._own.setdefault(iid, Counter())[lora] += 1

    def left(self, request_id: str) -> None:
        """The request finished, failed or moved: its instances no longer run it."""
        entry = self._placed.pop(request_id, None)
        if entry is None:
            return
        lora, where = entry
        for iid in where:
            own = self._own[iid]
            own[lora] -= 1
            if own[lora] <= 0:
                del own[lora]

    def candidates(self, lora: str, pool: list[InstanceState]) -> list[InstanceState]:
        """The instances of ``pool`` that can run ``lora`` without waiting for a slot; the
        whole pool if none can. Instances without a known slot count count as free."""
        ready = []
        for inst in pool:
            engine = self._engines.get(inst.id)
            if engine is not None:
                own = self._own.get(inst.id)
                on = engine.running.union(own) if own else engine.running
                if lora in engine.running:  # it runs there, but keeps a waiting adapter out
                    if len(on) > engine.max_loras:
                        continue
                elif len(on) + (lora not in on) > engine.max_loras:
                    continue  # it needs a slot of its own among those on it
            ready.append(inst)
        return ready or pool
