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

Adapter loads (routing/adapter_loads.py): an engine reads an adapter it does not hold in host
memory from disk before it runs it, so an instance where the adapter is not resident is
charged that load in its predicted TTFT (``load_costs``); the placement then weighs a load on
an idle instance against a wait where the adapter is. Not where the adapter holds another out
of its slot: a load saved there is paid by the waiting adapter (docs/real-engines.md §5).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from routing.adapter_loads import AdapterLoads
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
        self.loads = AdapterLoads()  # configured by the Conductor's settings
        self._engines: dict[str, EngineAdapters] = {}
        self._own: dict[str, Counter[str]] = {}  # instance -> adapter -> requests in flight
        # request -> adapter, where, and whether its first token can teach the adapter load
        self._placed: dict[str, tuple[str, frozenset[str], bool]] = {}

    def engine_state(self, instance_id: str, state: EngineAdapters | None) -> None:
        if state is None:
            self._engines.pop(instance_id, None)
            self.loads.forget(instance_id)
        else:
            self._engines[instance_id] = state
            for adapter in state.running:  # running: in host memory
                self.loads.ran(instance_id, adapter, state.max_loras)

    def slots(self, instance_id: str) -> EngineAdapters | None:
        return self._engines.get(instance_id)

    def placed(self, lora: str, decision: Decision) -> None:
        """An adapter's request is (now) on ``decision``'s instances (either leg)."""
        self.left(decision.request_id)
        where = frozenset((decision.prefill, decision.decode))
        clean = decision.predicted_queue_s == 0.0 and self._runs_at_once(lora, decision.prefill)
        self._placed[decision.request_id] = (lora, where, clean)
        for iid in where:
            self._own.setdefault(iid, Counter())[lora] += 1
            engine = self._engines.get(iid)
            if engine is not None:
                self.loads.ran(iid, lora, engine.max_loras)

    def left(self, request_id: str) -> None:
        """The request finished, failed or moved: its instances no longer run it."""
        entry = self._placed.pop(request_id, None)
        if entry is None:
            return
        lora, where, _ = entry
        for iid in where:
            own = self._own[iid]
            own[lora] -= 1
            if own[lora] <= 0:
                del own[lora]

    def candidates(self, lora: str, pool: list[InstanceState]) -> list[InstanceState]:
        """The instances of ``pool`` that can run ``lora`` without waiting for a slot; the
        whole pool if none can. Instances without a known slot count count as free."""
        ready = [inst for inst in pool if self._runs_at_once(lora, inst.id)]
        return ready or pool

    def _holds_out(self, lora: str, instance_id: str) -> bool:
        """``lora`` runs on the instance while another adapter waits there for its slot."""
        engine = self._engines.get(instance_id)
        if engine is None or lora not in engine.running:
            return False
        own = self._own.get(instance_id)
        return len(engine.running.union(own) if own else engine.running) > engine.max_loras

    def _runs_at_once(self, lora: str, instance_id: str) -> bool:
        engine = self._engines.get(instance_id)
        if engine is None:
            return True
        own = self._own.get(instance_id)
        on = engine.running.union(own) if own else engine.running
        if lora in engine.running:  # it runs there, but keeps a waiting adapter out
            return len(on) <= engine.max_loras
        return len(on) + (lora not in on) <= engine.max_loras  # a slot of its own among them

    def load_costs(self, lora: str, pool: list[InstanceState]) -> dict[str, float]:
        """The instances of ``pool`` (with adapter slots) that do not hold ``lora`` in host
        memory, each with the predicted load (0.0 until one is learned: still marked, so its
        first token teaches the load). Where ``lora`` runs while another adapter waits for its
        slot, its load is charged all the same: a load saved there would be paid for by the
        waiting adapter's longer wait (the starvation bound, when the fleet has no free slot)."""
        load = self.loads.load_s()
        return {
            inst.id: load
            for inst in pool
            if (engine := self._engines.get(inst.id)) is not None
            and (
                self._holds_out(lora, inst.id)
                or (lora not in engine.running and not self.loads.resident(inst.id, lora))
            )
        }

    def first_token(self, decision: Decision, observed_ttft_s: float) -> None:
        """An adapter request's first token came ``observed_ttft_s`` after its dispatch. It
        teaches the load only if it was placed on an engine with adapter slots where nothing
        was queued and the adapter could run at once: a wait for a slot or behind a queue the
        books mispredict would pass for a load (on the emulated fleet, 2.9 s learned for a
        0.5 s load when every first token counted)."""
        entry = self._placed.get(decision.request_id)
        if entry is not None and entry[2] and decision.prefill in self._engines:
            residual = observed_ttft_s - decision.predicted_ttft_s
            self.loads.observe(residual, decision.adapter_load_s)
