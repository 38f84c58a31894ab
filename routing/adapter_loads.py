"""Which LoRA adapters an engine holds in host memory, and what reading one in costs.

vLLM keeps the ``--max-cpu-loras`` adapters it ran last in host memory (default: as many as
``--max-loras``, 1) and reads any other from disk inside the step that first runs it: the
whole batch waits for the load (as long as the adapter's size and the disk make it; for the
tiny test adapter on this CPU, below what the machine resolves: docs/real-engines.md §5).
vLLM 0.32 does not say which adapters it holds, so kvgate keeps its own book: per instance,
the adapters its requests ran there last (an LRU of that size), and the adapters the engine
lists as running.

The load time is learned from first tokens (or fixed by config): a request placed where its
adapter was not resident ("cold") shows the load in its TTFT residual (observed - predicted,
without the load it was charged) beside the residual of the adapter requests that found theirs
resident; the estimate is the difference of the two running means, so a predictor that errs
for every request does not count as a load. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


def use_adapters(
    held: OrderedDict[str, None], adapters: Iterable[str], capacity: int | None
) -> None:
    """``adapters`` ran: the most recently used of ``held`` (least recent first), which keeps
    ``capacity`` (None: all; vLLM's host-memory LRU, which the engine model keeps too)."""
    for adapter in adapters:
        held[adapter] = None
        held.move_to_end(adapter)
    while capacity is not None and len(held) > capacity:
        held.popitem(last=False)


@dataclass(slots=True)
class ResidualMean:
    """An exponentially weighted mean; ``n`` samples seen."""

    weight: float
    value: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        # The first samples weigh 1/n, so an early mean is the plain mean, not 0-biased.
        self.value += (x - self.value) * max(self.weight, 1.0 / self.n)


class AdapterLoads:
    """Per instance, the adapters it holds in host memory by kvgate's book; the load time of
    one that is not (``fixed_s``, else learned; 0 until a cold first token is seen)."""

    def __init__(
        self, cpu_adapters: int = 0, fixed_s: float | None = None, weight: float = 0.2
    ) -> None:
        self.cpu_adapters = cpu_adapters  # 0: each engine's --max-loras, vLLM's default
        self.fixed_s = fixed_s
        self.cold = ResidualMean(weight)
        self.warm = ResidualMean(weight)
        self._held: dict[str, OrderedDict[str, None]] = {}  # instance -> adapters, LRU first

    def ran(self, instance_id: str, adapter: str, max_loras: int) -> None:
        """``adapter`` runs on the instance now (kvgate sent it, or the engine lists it)."""
        held = self._held.setdefault(instance_id, OrderedDict())
        use_adapters(held, (adapter,), max(self.cpu_adapters or max_loras, 1))

    def resident(self, instance_id: str, adapter: str) -> bool:
        held = self._held.get(instance_id)
        return held is not None and adapter in held

    def forget(self, instance_id: str) -> None:
        """The engine restarted or left: it holds nothing kvgate knows of."""
        self._held.pop(instance_id, None)

    def load_s(self) -> float:
        """The predicted time to read in an adapter that is not resident."""
        if self.fixed_s is not None:
            return self.fixed_s
        if not self.cold.n:
            return 0.0
        return max(self.cold.value - (self.warm.value if self.warm.n else 0.0), 0.0)

    def observe(self, residual_s: float, charged_s: float | None) -> None:
        """An adapter request's first token: ``residual_s`` = observed - predicted TTFT;
        ``charged_s`` the load it was charged when placed cold (None: resident)."""
        if charged_s is None:
            self.warm.add(residual_s)
        else:
            self.cold.add(residual_s + charged_s)

    def as_dict(self) -> dict[str, object]:
        """For /admin/predictors: the load charged, and the first tokens it was learned from."""
        return {
            "load_s": round(self.load_s(), 4),
            "configured": self.fixed_s is not None,
            "cold_samples": self.cold.n,
            "resident_samples": self.warm.n,
        }
