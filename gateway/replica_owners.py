"""Which instance made each Responses API answer, shared among kvgate replicas.

Only the engine that stored a response can continue it (``previous_response_id``,
gateway/responses_api.py), and only the replica that relayed the answer learns which instance
that is. So each replica publishes the owners it learned, on the exchange's PUB socket under
their own topic, and merges its peers' into its own book: a follow-up that a load balancer
sends to another replica still reaches the instance that holds the response.

Owners are facts, not load: they are sent once each, repeated in the next ``REPEATS`` interval
messages (PUB/SUB may drop one; a later copy covers it), never as whole books. A replica that
joins later learns only the owners made after it connected (docs/replicas.md, Limits).

Wire: frames ``[b"kvgate.owners", payload]``; payload a msgpack map ``{"v": 1, "r": replica,
"o": [[response_id, instance_id], ...]}``. Replicas from before this topic never subscribe
to it (ZMQ filters by topic prefix), so mixed versions keep working.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import msgpack

from gateway.replica_snapshot import VERSION, unpack_map

OWNERS_TOPIC = b"kvgate.owners"
REPEATS = 3  # interval messages that carry each owner
MAX_PER_MESSAGE = 50_000  # beyond this the oldest pending owners are dropped, not sent
_MAX_ID = 256  # characters of a response or instance id


class OwnerBook(Protocol):
    """Where owners live (gateway/response_owners.py)."""

    def take_fresh(self) -> list[tuple[str, str]]: ...

    def learn(self, pairs: Iterable[tuple[str, str]]) -> int: ...


class OwnersError(ValueError):
    """A payload that is not a version-1 owners message."""


@dataclass(frozen=True, slots=True)
class OwnersMessage:
    replica: str
    owners: tuple[tuple[str, str], ...]


def encode_owners(msg: OwnersMessage) -> bytes:
    return msgpack.packb({"v": VERSION, "r": msg.replica, "o": [list(p) for p in msg.owners]})


def _ident(x: object, what: str) -> str:
    if not isinstance(x, str) or not x or len(x) > _MAX_ID:
        raise OwnersError(f"{what} must be a string of 1-{_MAX_ID} characters")
    return x


def decode_owners(payload: bytes) -> OwnersMessage:
    msg = unpack_map(payload, OwnersError, "owners message")
    pairs = msg.get("o")
    if not isinstance(pairs, list):
        raise OwnersError("'o' must be a list of [response_id, instance_id]")
    owners = []
    for pair in pairs:
        if not isinstance(pair, list) or len(pair) != 2:
            raise OwnersError("each owner must be [response_id, instance_id]")
        owners.append((_ident(pair[0], "response_id"), _ident(pair[1], "instance_id")))
    return OwnersMessage(_ident(msg.get("r"), "replica id"), tuple(owners))


class OwnerRelay:
    """What this replica's next owners message carries: what the book learned since the last
    one, and what earlier messages carried fewer than ``REPEATS`` times."""

    def __init__(self, book: OwnerBook, replica: str) -> None:
        self.book = book
        self.replica = replica
        self._pending: deque[tuple[list[tuple[str, str]], int]] = deque()  # batch, sends left
        self.sent = 0  # owners sent for the first time
        self.learned = 0  # owners learned from peers

    def next_message(self) -> bytes | None:
        fresh = self.book.take_fresh()
        if fresh:
            self._pending.append((fresh, REPEATS))
            self.sent += len(fresh)
        while sum(len(b) for b, _ in self._pending) > MAX_PER_MESSAGE and len(self._pending) > 1:
            self._pending.popleft()
        if not self._pending:
            return None
        owners = tuple(p for batch, _ in self._pending for p in batch)[-MAX_PER_MESSAGE:]
        self._pending = deque((b, left - 1) for b, left in self._pending if left > 1)
        return encode_owners(OwnersMessage(self.replica, owners))

    def receive(self, payload: bytes) -> bool:
        """Merge a peer's owners into the book; False for this replica's own message.
        Raises OwnersError for a malformed one."""
        msg = decode_owners(payload)
        if msg.replica == self.replica:
            return False
        self.learned += self.book.learn(msg.owners)
        return True
