"""Which instance made each Responses API answer: only the engine that stored a response can
continue it (``previous_response_id``, gateway/responses_api.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ResponseOwners:
    """Which instance made each response id (the most recent ``limit``), so that a follow-up
    naming it as ``previous_response_id`` is placed where the engine stored it. ``shared``
    (replicas on): what this replica learns itself is also kept for ``take_fresh``, which the
    replica exchange sends to its peers; what they send comes in through ``learn``."""

    __slots__ = ("_fresh", "_owner", "limit", "shared")

    def __init__(self, limit: int = 100_000, *, shared: bool = False) -> None:
        self.limit = limit
        self.shared = shared
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._fresh: list[tuple[str, str]] = []

    def _put(self, response: str, instance_id: str) -> bool:
        new = self._owner.get(response) != instance_id
        self._owner[response] = instance_id
        self._owner.move_to_end(response)
        if len(self._owner) > self.limit:
            self._owner.popitem(last=False)
        return new

    def remember(self, response: str, instance_id: str) -> None:
        """This replica relayed the response from ``instance_id``."""
        self._put(response, instance_id)
        if self.shared:
            self._fresh.append((response, instance_id))
            if len(self._fresh) > self.limit:  # nobody takes them: keep the newest only
                del self._fresh[: len(self._fresh) - self.limit]

    def learn(self, pairs: Iterable[tuple[str, str]]) -> int:
        """A peer replica's owners; returns how many were new here."""
        return sum(self._put(response, instance_id) for response, instance_id in pairs)

    def take_fresh(self) -> list[tuple[str, str]]:
        """The owners remembered here since the last call (for the peers), oldest first."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def owner(self, response: str) -> str | None:
        return self._owner.get(response)

    def __len__(self) -> int:
        return len(self._owner)
