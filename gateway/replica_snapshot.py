"""The replica exchange's work snapshot on the wire (gateway/replica_exchange.py sends and
receives it): one replica's dispatched-but-unfinished work per instance, as msgpack.

Payload: a map ``{"v": 1, "r": replica, "e": epoch, "s": seq, "bye": bool, "i": {instance:
[prefills, decodes]}}`` with prefills ``[prompt_tokens, remaining_s, ready_in_s]`` and decodes
``[prompt_tokens, predicted_output, generated, arrival_in_s | nil]`` (times relative to
sending). A payload from a peer is checked field by field: a bad one raises SnapshotError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from routing.replica_load import DecodeItem, InstanceWork, PrefillItem

VERSION = 1


class SnapshotError(ValueError):
    """A payload that is not a version-1 snapshot."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    replica: str
    epoch: int
    seq: int
    work: dict[str, InstanceWork] = field(default_factory=dict)
    bye: bool = False


def encode(snap: Snapshot) -> bytes:
    inst = {
        iid: [
            [[p.prompt_tokens, p.remaining_s, p.ready_in_s] for p in w.prefills],
            [[d.prompt_tokens, d.predicted_output, d.generated, d.arrival_in_s] for d in w.decodes],
        ]
        for iid, w in snap.work.items()
    }
    return msgpack.packb(
        {
            "v": VERSION,
            "r": snap.replica,
            "e": snap.epoch,
            "s": snap.seq,
            "bye": snap.bye,
            "i": inst,
        }
    )


def _num(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or x != x or x < 0:
        raise SnapshotError(f"{what} must be a non-negative number, got {x!r}")
    return float(x)


def _count(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise SnapshotError(f"{what} must be a non-negative integer, got {x!r}")
    return x


def unpack_map(payload: bytes, error: type[ValueError], what: str) -> dict[str, Any]:
    """A version-1 msgpack map of the exchange, or ``error`` (also the owners' messages)."""
    try:
        msg = msgpack.unpackb(payload, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise error(f"not msgpack: {exc}") from exc
    if not isinstance(msg, dict) or msg.get("v") != VERSION:
        raise error(f"not a version-{VERSION} {what}")
    return msg


def decode(payload: bytes) -> Snapshot:
    msg = unpack_map(payload, SnapshotError, "snapshot")
    replica, inst = msg.get("r"), msg.get("i", {})
    if not isinstance(replica, str) or not replica or "\x00" in replica:
        raise SnapshotError("replica id must be a non-empty string")
    if not isinstance(inst, dict):
        raise SnapshotError("'i' must map instance ids to work")
    work: dict[str, InstanceWork] = {}
    try:
        for iid, (pre, dec) in inst.items():
            if not isinstance(iid, str):
                raise SnapshotError("instance ids must be strings")
            prefills = tuple(
                PrefillItem(_count(t, "prompt_tokens"), _num(r, "remaining_s"), _num(w, "ready"))
                for t, r, w in pre
            )
            decodes = tuple(
                DecodeItem(
                    _count(t, "prompt_tokens"),
                    _count(o, "predicted_output"),
                    _count(g, "generated"),
                    None if a is None else _num(a, "arrival_in_s"),
                )
                for t, o, g, a in dec
            )
            work[iid] = InstanceWork(prefills, decodes)
    except (TypeError, ValueError) as exc:  # wrong shapes: unpacking a non-list, wrong arity
        if isinstance(exc, SnapshotError):
            raise
        raise SnapshotError(f"malformed work: {exc}") from exc
    return Snapshot(
        replica,
        _count(msg.get("e", 0), "epoch"),
        _count(msg.get("s", 0), "seq"),
        work,
        bool(msg.get("bye", False)),
    )
