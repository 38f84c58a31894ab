"""How often the prefix of a long prompt is asked for again: the value of serving it late.

A prompt that misses the TTFT SLO even on an idle instance ("doomed") can still be worth its
prefill: the KV it leaves behind lets the session's later turns, which extend it, meet the
SLO. Whether that pays depends on the workload. On the Mooncake synthetic trace 72-76 % of
prompts over 30k tokens are extended by a later request; on the conversation trace 30 %
(docs/experiments.md §2.3). This tracker measures that rate online, from the requests
themselves: each doomed prompt is watched until a later request extends it (reused) or
``horizon_s`` passes (not reused). The rate is taken over the last ``window`` outcomes, with
a one-in-two prior so that a fresh gateway starts undecided rather than certain.

Pure and bounded: at most ``capacity`` prompts are watched (the oldest counts as not reused
when a newer one needs its place), time comes from the caller.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

# A prompt counts as extended when a later prompt contains the block at 90 % of its length:
# a follow-up turn repeats the earlier prompt, but the last (partial) block may differ.
_COVER = 0.9


class PrefixReuse:
    __slots__ = ("_extended", "_outcomes", "_reused", "_watch", "capacity", "horizon_s")

    def __init__(self, horizon_s: float = 300.0, capacity: int = 4096, window: int = 256) -> None:
        if horizon_s <= 0 or capacity < 1 or window < 1:
            raise ValueError("horizon_s, capacity and window must be positive")
        self.horizon_s = horizon_s
        self.capacity = capacity
        self._watch: OrderedDict[int, float] = OrderedDict()  # key block -> watched since
        self._extended: set[int] = set()  # watched keys a later request extended
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._reused = 0

    @staticmethod
    def key(block_hashes: Sequence[int]) -> int | None:
        if not block_hashes:
            return None
        return block_hashes[max(1, int(len(block_hashes) * _COVER)) - 1]

    def watch(self, block_hashes: Sequence[int], now: float) -> None:
        """A doomed prompt arrived: watch whether a later request extends it."""
        key = self.key(block_hashes)
        if key is None or key in self._watch:  # a repeat: ``observe`` counted it
            return
        self._watch[key] = now
        while len(self._watch) > self.capacity:
            self._resolve(*self._watch.popitem(last=False))

    def observe(self, block_hashes: Sequence[int], now: float) -> None:
        """Any request: note the watched prompts it extends; settle those past the horizon.

        An outcome is settled only when its horizon ends, extended or not: settling the
        extended ones at once would count them before the others and bias the rate up."""
        watch = self._watch
        if not watch:
            return
        extended = self._extended
        for h in block_hashes:
            if h in watch:
                extended.add(h)
        expire = now - self.horizon_s
        while watch:
            key, since = next(iter(watch.items()))
            if since > expire:
                break
            del watch[key]
            self._resolve(key, since)

    def _resolve(self, key: int, _since: float) -> None:
        reused = key in self._extended
        self._extended.discard(key)
        out = self._outcomes
        if len(out) == out.maxlen and out[0]:
            self._reused -= 1
        out.append(reused)
        self._reused += reused

    @property
    def rate(self) -> float:
        """Share of watched prompts extended within the horizon (prior: 1 of 2)."""
        return (self._reused + 1.0) / (len(self._outcomes) + 2.0)

    @property
    def settled(self) -> int:
        return len(self._outcomes)

    @property
    def watched(self) -> int:
        return len(self._watch)
