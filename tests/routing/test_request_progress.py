"""The Conductor's books after a decision (routing/request_progress.py): a request that runs
somewhere other than decided (a proxy's fallback) is rebooked there. Real Conductor, real
KV index."""

from __future__ import annotations

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

    pd = make_conductor(prefill=2, decode=1)
    split = _placed(pd, "s", prompt(3, 4))
    assert split.prefill != split.decode
    assert pd.rebook("s", "p1" if split.prefill == "p0" else "p0", 0.1) is None  # P/D: not moved
