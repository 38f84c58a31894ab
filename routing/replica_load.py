"""Other kvgate replicas' dispatched-but-unfinished work, merged into this replica's books.

Several replicas in front of one fleet each keep books only of what they dispatched, so each
sees a fraction of the committed load: admission admits too much and placement herds onto the
instances that look idle to everyone. Each replica therefore publishes its own work per
instance (``own_work``) and takes the others' (``ReplicaLoad.set_peer_load``). Peer work joins
the instance's books as ordinary entries (prefill queue, decode incoming/running) under ids no
request can have, so every consumer of the books (queue time, committed TBT, the decode
forecast, KV fit, the policies) counts it without knowing where it came from.

A snapshot is the peer's whole current work, not a delta: a lost or late message costs nothing
but freshness, and a replica that stops publishing has its share expire after ``ttl_s``.
Times travel relative to the snapshot ("finishes in 0.3 s"), so replicas need no common clock.
Pure: ``now`` is always an argument.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from routing.instance_books import DecodeWork, InstanceState

# Injected entries are keyed "<PEER_PREFIX><replica>/<n>": a NUL never occurs in the request ids
# the gateway accepts or makes, so peer entries cannot collide with own requests.
PEER_PREFIX = "\x00peer:"


@dataclass(frozen=True, slots=True)
class PrefillItem:
    prompt_tokens: int
    remaining_s: float  # predicted prefill execution still to run
    ready_in_s: float = 0.0  # earliest start from now (a prefix pull still in flight)


@dataclass(frozen=True, slots=True)
class DecodeItem:
    prompt_tokens: int
    predicted_output: int
    generated: int = 0
    arrival_in_s: float | None = None  # None: decoding now; else KV expected in this long


@dataclass(frozen=True, slots=True)
class InstanceWork:
    """One replica's work on one instance."""

    prefills: tuple[PrefillItem, ...] = ()
    decodes: tuple[DecodeItem, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


def own_work(
    request_ids: Mapping[str, object],
    instances: Mapping[str, InstanceState],
    now: float,
) -> dict[str, InstanceWork]:
    """This replica's own work per instance, from its books: the entries of the requests it
    dispatched (``request_ids``: the Conductor's request records; peer entries are not in it)."""
    prefills: dict[str, list[PrefillItem]] = {}
    decodes: dict[str, list[DecodeItem]] = {}
    for inst in instances.values():
        for rid, p in inst.prefill_queue.items():
            if rid in request_ids:
                started = p.est_start_s <= now
                left = p.est_finish_s - now if started else p.duration_s
                prefills.setdefault(inst.id, []).append(
                    PrefillItem(p.prompt_tokens, max(left, 0.0), max(p.ready_s - now, 0.0))
                )
        for books, running in ((inst.incoming, False), (inst.running, True)):
            for rid, d in books.items():
                if rid in request_ids:
                    arrival = None if running else max(d.est_arrival_s - now, 0.0)
                    decodes.setdefault(inst.id, []).append(
                        DecodeItem(d.prompt_tokens, d.predicted_output, d.generated, arrival)
                    )
    return {
        iid: InstanceWork(tuple(prefills.get(iid, ())), tuple(decodes.get(iid, ())))
        for iid in prefills.keys() | decodes.keys()
    }


@dataclass(slots=True)
class _Peer:
    epoch: int
    seq: int
    expires_s: float
    # instance id -> (prefill entry ids, decode entry ids) this peer's snapshot put there
    entries: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)


class ReplicaLoad:
    """The peers' shares of the books of ``instances`` (the Conductor's, shared by reference)."""

    def __init__(self, instances: Mapping[str, InstanceState]) -> None:
        self._instances = instances
        self._peers: dict[str, _Peer] = {}

    @property
    def peers(self) -> dict[str, float]:
        """Replica id -> when its share expires."""
        return {r: p.expires_s for r, p in self._peers.items()}

    def set_peer_load(
        self,
        replica: str,
        work: Mapping[str, InstanceWork],
        now: float,
        *,
        ttl_s: float,
        seq: int = 0,
        epoch: int = 0,
    ) -> bool:
        """Replace ``replica``'s share with ``work`` (its snapshot taken just now); it expires at
        ``now + ttl_s`` unless refreshed. A snapshot older than the last one taken from the same
        run of the replica (same ``epoch``, lower or equal ``seq``) is ignored: returns False.
        Instances this replica does not know are skipped (fleets converge through config)."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be > 0")
        peer = self._peers.get(replica)
        if peer is not None and peer.epoch == epoch and seq <= peer.seq:
            return False
        if peer is not None:
            self._remove(replica, peer, now)
        peer = self._peers[replica] = _Peer(epoch, seq, now + ttl_s)
        n = 0
        for iid, w in work.items():
            inst = self._instances.get(iid)
            if inst is None or not w:
                continue
            pre: list[str] = []
            dec: list[str] = []
            for p in w.prefills:
                rid = f"{PEER_PREFIX}{replica}/{n}"
                n += 1
                inst.enqueue_prefill(
                    rid, p.remaining_s, p.prompt_tokens, now, now + max(p.ready_in_s, 0.0)
                )
                pre.append(rid)
            for d in w.decodes:
                rid = f"{PEER_PREFIX}{replica}/{n}"
                n += 1
                arrival = now + (d.arrival_in_s or 0.0)
                inst.add_incoming(
                    DecodeWork(rid, d.prompt_tokens, d.predicted_output, arrival, 0.0, d.generated)
                )
                if d.arrival_in_s is None:
                    inst.start_decode(rid, now)
                dec.append(rid)
            peer.entries[iid] = (pre, dec)
        return True

    def expire(self, now: float) -> list[str]:
        """Drop the shares of replicas not heard from within their TTL; returns their ids."""
        gone = [r for r, p in self._peers.items() if p.expires_s <= now]
        for r in gone:
            self.forget(r, now)
        return gone

    def forget(self, replica: str, now: float) -> None:
        peer = self._peers.pop(replica, None)
        if peer is not None:
            self._remove(replica, peer, now)

    def clear(self, now: float) -> None:
        for r in list(self._peers):
            self.forget(r, now)

    def _remove(self, replica: str, peer: _Peer, now: float) -> None:
        for iid, (pre, dec) in peer.entries.items():
            inst = self._instances.get(iid)
            if inst is None:  # removed since: its books went with it
                continue
            inst.remove_prefills(pre, now)
            for rid in dec:
                inst.remove_decode(rid, now)
        peer.entries.clear()
