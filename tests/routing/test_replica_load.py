"""Peer replicas' work merged into the books (routing/replica_load.py): real Conductors."""

from __future__ import annotations

import pytest

from config.settings import AdmissionMode
from routing.replica_load import (
    PEER_PREFIX,
    DecodeItem,
    InstanceWork,
    PrefillItem,
    ReplicaLoad,
    own_work,
)
from routing.types import Decision, Rejection
from tests.routing.fleet import make_conductor, prompt, request


def _dispatch(c, rid: str, family: int, blocks: int = 256, now: float = 0.0) -> Decision:
    req = request(rid, prompt(family, blocks), now=now, max_tokens=200)
    d = c.schedule(req, now)
    assert isinstance(d, Decision)
    c.dispatched(d, req, now)
    return d


def _totals(c) -> dict[str, tuple]:
    return {
        i.id: (len(i.prefill_queue), i.queued_tokens, len(i.incoming), i.batch, i.reserved_tokens)
        for i in c.instances.values()
    }


def test_own_work_reports_each_dispatched_request_once() -> None:
    a = make_conductor(prefill=2, decode=2)
    d = _dispatch(a, "r1", 1)
    work = own_work(a.requests, a.instances, 0.0)
    assert set(work) == {d.prefill, d.decode}
    (p,) = work[d.prefill].prefills
    assert p.prompt_tokens == 256 * 16
    assert p.remaining_s == pytest.approx(d.predicted_prefill_s + d.predicted_load_s)
    (dec,) = work[d.decode].decodes
    assert dec.arrival_in_s is not None and dec.arrival_in_s >= p.remaining_s
    assert dec.predicted_output == d.predicted_output_tokens
    a.prefill_done("r1", 0.5)
    a.tokens("r1", 7, 0.6)
    work = own_work(a.requests, a.instances, 0.6)
    assert d.prefill not in work
    assert work[d.decode].decodes == (DecodeItem(256 * 16, d.predicted_output_tokens, 7, None),)


def test_peer_work_counts_as_load_and_steers_placement() -> None:
    a, b = make_conductor(prefill=2, decode=2), make_conductor(prefill=2, decode=2)
    da = _dispatch(a, "a1", 1, blocks=512)
    # Without the exchange B places its request exactly where A did: both see an empty fleet.
    alone = b.schedule(request("b1", prompt(2, 512)), 0.0)
    assert isinstance(alone, Decision) and alone.prefill == da.prefill
    peers = ReplicaLoad(b.instances)
    assert peers.set_peer_load("A", own_work(a.requests, a.instances, 0.0), 0.0, ttl_s=0.15)
    assert b.instances[da.prefill].queue_time(0.0) == pytest.approx(
        a.instances[da.prefill].queue_time(0.0)
    )
    assert b.instances[da.decode].committed_key == pytest.approx(
        a.instances[da.decode].committed_key
    )
    shared = b.schedule(request("b1", prompt(2, 512)), 0.0)
    assert isinstance(shared, Decision)
    assert shared.prefill != da.prefill and shared.decode != da.decode
    # B's own snapshot leaves the peer's entries out (no echo between replicas).
    assert own_work(b.requests, b.instances, 0.0) == {}


def test_snapshot_replaces_the_previous_one_and_stale_ones_are_ignored() -> None:
    b = make_conductor(prefill=2, decode=2)
    peers = ReplicaLoad(b.instances)
    one = {
        "p0": InstanceWork((PrefillItem(1000, 1.0),)),
        "d0": InstanceWork((), (DecodeItem(1000, 50, 10),)),
    }
    two = {"p1": InstanceWork((PrefillItem(2000, 2.0), PrefillItem(500, 0.5)))}
    assert peers.set_peer_load("A", one, 0.0, ttl_s=1.0, seq=1)
    assert (b.instances["d0"].batch, b.instances["d0"].context_tokens) == (1, 1010)
    assert peers.set_peer_load("A", two, 0.1, ttl_s=1.0, seq=2)
    assert b.instances["p0"].queue_time(0.1) == 0.0 and b.instances["d0"].batch == 0
    assert b.instances["p1"].queue_time(0.1) == pytest.approx(2.5)
    assert b.instances["p1"].queued_tokens == 2500
    assert not peers.set_peer_load("A", one, 0.2, ttl_s=1.0, seq=2)  # same run, not newer
    assert b.instances["p1"].queued_tokens == 2500
    assert peers.set_peer_load("A", one, 0.2, ttl_s=1.0, seq=1, epoch=7)  # restarted replica
    assert b.instances["p1"].queued_tokens == 0 and b.instances["p0"].queued_tokens == 1000


def test_a_silent_peer_expires_and_the_books_return_to_own_work() -> None:
    b = make_conductor(prefill=2, decode=2)
    _dispatch(b, "own", 3)
    before = _totals(b)
    peers = ReplicaLoad(b.instances)
    work = {
        "p0": InstanceWork((PrefillItem(4096, 0.8, 0.2),)),
        "p1": InstanceWork((PrefillItem(4096, 0.8),)),
        "d0": InstanceWork((), (DecodeItem(4096, 100, 0, 1.0), DecodeItem(800, 100, 40))),
        "d1": InstanceWork((), (DecodeItem(800, 100, 40),)),
        "gone": InstanceWork((PrefillItem(1, 1.0),)),  # not in this fleet: skipped
    }
    peers.set_peer_load("A", work, 1.0, ttl_s=0.15)
    peers.set_peer_load("B", {"d1": InstanceWork((), (DecodeItem(800, 100, 1),))}, 1.05, ttl_s=0.15)
    assert _totals(b) != before
    assert peers.expire(1.14) == []
    assert peers.expire(1.15) == ["A"]
    assert set(peers.peers) == {"B"}
    peers.forget("B", 1.16)
    assert _totals(b) == before
    assert not any(
        rid.startswith(PEER_PREFIX)
        for i in b.instances.values()
        for rid in (*i.prefill_queue, *i.incoming, *i.running)
    )


def test_replacing_peer_entries_keeps_own_running_prefill_finish() -> None:
    b = make_conductor(prefill=1, decode=1)
    d = _dispatch(b, "own", 4, blocks=512)
    p = b.instances[d.prefill]
    finish = p.prefill_queue["own"].est_finish_s
    peers = ReplicaLoad(b.instances)
    for k in range(5):  # a snapshot every 50 ms while the own prefill runs
        peers.set_peer_load(
            "A", {"p0": InstanceWork((PrefillItem(100, 0.3),))}, k * 0.05, ttl_s=1, seq=k
        )
    assert p.prefill_queue["own"].est_finish_s == pytest.approx(finish)
    assert p.queue_time(0.2) == pytest.approx(finish + 0.3 - 0.2)


def test_peer_load_makes_admission_reject_what_one_replica_alone_admits() -> None:
    kw = {"prefill": 1, "decode": 1, "admission": AdmissionMode.EARLY}
    a, b = make_conductor(**kw), make_conductor(**kw)
    for k in range(500):  # A fills the one prefill instance up to the TTFT SLO (30 s)
        req = request(f"a{k}", prompt(100 + k, 512))
        d = a.schedule(req, 0.0)
        if isinstance(d, Rejection):
            break
        a.dispatched(d, req, 0.0)
    assert isinstance(d, Rejection)  # A itself has reached the SLO
    assert isinstance(b.schedule(request("b1", prompt(7, 512)), 0.0), Decision)
    ReplicaLoad(b.instances).set_peer_load(
        "A", own_work(a.requests, a.instances, 0.0), 0.0, ttl_s=1
    )
    assert isinstance(b.schedule(request("b1", prompt(7, 512)), 0.0), Rejection)


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        ReplicaLoad({}).set_peer_load("A", {}, 0.0, ttl_s=0.0)


def test_removing_an_instance_fails_own_requests_only_and_peers_forget_cleanly() -> None:
    b = make_conductor(prefill=2, decode=2)
    d = _dispatch(b, "own", 5)
    peers = ReplicaLoad(b.instances)
    peers.set_peer_load("A", {d.prefill: InstanceWork((PrefillItem(100, 1.0),))}, 0.0, ttl_s=1)
    assert b.remove_instance(d.prefill, 0.1) == ["own"]
    peers.forget("A", 0.2)  # its instance is gone: nothing to take out, no error
    assert not peers.peers
