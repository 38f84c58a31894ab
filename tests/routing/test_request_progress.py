"""The Conductor's books after a decision (routing/request_progress.py): a request that runs
somewhere other than decided (a proxy's fallback) is rebooked there. Real Conductor, real
KV index."""

from __future__ import annotations

import pytest

from routing.conductor import Conductor
from routing.types import Decision
from tests.routing.fleet import BLOCK, hold, make_conductor, prompt, request


def _placed(c: Conductor, rid: str, blocks: tuple[int, ...]) -> Decision:
    req = request(rid, blocks)
    d = c.schedule(req, 0.0)
    assert isinstance(d, Decision)
    c.dispatched(d, req, 0.0)
    return d


def test_rebook_moves_the_books_and_the_route_to_the_instance_that_serves() -> None:
    c = make_conductor(prefill=0, decode=0, colocated=3)
    shared = prompt(1, 6)
    for holder in ("c1", "c2"):  # part of the prefix, on two instances
        hold(c, holder, shared[:4])
    d = _placed(c, "r", shared)
    pick = d.prefill
    other = "c2" if pick == "c1" else "c1"  # a holder the request did not go to
    assert c.index.is_predicted(pick, shared[-1])  # the route credited the pick

    moved = c.rebook("r", other, 0.5)

    assert moved is not None and moved.prefill == moved.decode == other
    assert moved.reason == "fallback" and moved.cached_tokens == 4 * BLOCK
    assert moved.predicted_transfer_s == 0.0 and moved.pull_source is None
    assert not c.index.is_predicted(pick, shared[-1])  # the pick never cached it
    assert c.index.is_predicted(other, shared[-1])  # the fallback will
    assert "r" not in c.instances[pick].prefill_queue
    assert "r" in c.instances[other].prefill_queue and "r" in c.instances[other].incoming
    rec = c.requests["r"]
    assert rec.decision is moved and rec.dispatched_s == 0.0  # TTFT still from the pick
    assert c.first_token("r", 2.0) == 2.0
    c.finished("r", 3.0, output_tokens=4)
    assert not c.requests and all(not i.prefill_queue for i in c.instances.values())


def test_rebook_refuses_what_it_cannot_move() -> None:
    c = make_conductor(prefill=0, decode=0, colocated=2)
    d = _placed(c, "r", prompt(2, 4))
    other = "c0" if d.prefill == "c1" else "c1"
    assert c.rebook("r", d.prefill, 0.1) is None  # already there
    assert c.rebook("r", "nowhere", 0.1) is None
    assert c.rebook("gone", other, 0.1) is None
    c.first_token("r", 0.2)
    assert c.rebook("r", other, 0.3) is None  # it answered: the books are right already
    assert c.requests["r"].decision is d


def test_a_pd_request_moves_only_its_decode_to_the_decode_instance_that_served() -> None:
    c = make_conductor(prefill=2, decode=2)
    d = _placed(c, "s", prompt(3, 4))
    assert d.prefill != d.decode
    other = "d1" if d.decode == "d0" else "d0"
    assert c.rebook("s", "p1" if d.prefill == "p0" else "p0", 0.1) is None  # not a decode
    moved = c.rebook("s", other, 0.1)
    assert moved is not None and moved.decode == other and moved.prefill == d.prefill
    assert moved.reason == "fallback"
    assert "s" in c.instances[other].incoming and "s" not in c.instances[d.decode].incoming
    assert "s" in c.instances[d.prefill].prefill_queue  # the prefill stays where it was
    assert c.rebook("s", other, 0.2) is None  # already there
    c.first_token("s", 1.0)
    c.finished("s", 2.0, output_tokens=3)
    assert not c.requests and all(not i.running and not i.incoming for i in c.instances.values())


def test_a_colocated_decode_teaches_the_stall_credit_only_the_misses_its_neighbours_made() -> None:
    from dataclasses import replace

    from config.admission_settings import PrefillStallSettings
    from config.settings import AdmissionMode

    c = make_conductor(prefill=0, decode=0, colocated=1, admission=AdmissionMode.EARLY)
    stall = PrefillStallSettings(window=1, raise_step=0.1, lower_factor=0.5)
    c.apply_settings(
        replace(c.settings, admission=replace(c.settings.admission, prefill_stall=stall))
    )
    credit = c.admission.stall_credit_for(None)

    def decode_beside_a_prefill(rid: str, tbt_s: float) -> None:
        d = _placed(c, rid, prompt(ord(rid[0]), 4))
        c.prefill_done(rid, 0.1)
        c.instances["c0"].enqueue_prefill("neighbour", 1.0, 1024, 0.1, 0.1)  # 1 s predicted
        c.instances["c0"].finish_prefill("neighbour", 1.1)
        c.finished(rid, 2.1, output_tokens=11, tbt_s=tbt_s)  # 10 gaps: the 1 s is 0.1 s each
        assert c.requests.get(rid) is None and d.decode == "c0"

    decode_beside_a_prefill("a", 0.15)  # 0.15 - 0.1 = 0.05 <= 0.1: the stall made the miss
    assert credit.credit == pytest.approx(0.05) and credit.lowered == 1
    decode_beside_a_prefill("b", 0.25)  # 0.25 - 0.1 > 0.1: it missed anyway
    assert credit.credit == pytest.approx(0.15) and credit.raised == 1
