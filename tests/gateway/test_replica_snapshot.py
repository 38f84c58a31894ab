"""The replica exchange's work snapshot on the wire (gateway/replica_snapshot.py)."""

from __future__ import annotations

import msgpack
import pytest

from gateway.replica_snapshot import Snapshot, SnapshotError, decode, encode
from routing.replica_load import DecodeItem, InstanceWork, PrefillItem


def test_snapshot_round_trips_and_bad_payloads_are_refused() -> None:
    work = {
        "p0": InstanceWork((PrefillItem(4096, 0.25, 0.1),)),
        "d0": InstanceWork((), (DecodeItem(4096, 300, 0, 0.4), DecodeItem(900, 300, 12, None))),
    }
    snap = Snapshot("A", 12345, 7, work)
    assert decode(encode(snap)) == snap
    assert len(encode(snap)) < 120  # compact: a few bytes per request
    bad = [
        b"\xc1",
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2, "r": "A"}),
        msgpack.packb({"v": 1, "r": ""}),
        msgpack.packb({"v": 1, "r": "A", "i": {"p0": [[[1, -1.0, 0]], []]}}),
        msgpack.packb({"v": 1, "r": "A", "i": {"p0": [[[1, 0.5]], []]}}),
        msgpack.packb({"v": 1, "r": "A", "i": {"d0": [[], [[1, 2, True, None]]]}}),
        msgpack.packb({"v": 1, "r": "A", "i": {"p0": 3}}),
        msgpack.packb({"v": 1, "r": "A", "s": -1}),
    ]
    for payload in bad:
        with pytest.raises(SnapshotError):
            decode(payload)
