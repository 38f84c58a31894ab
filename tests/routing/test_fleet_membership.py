"""Fleet changes on a real Conductor (routing/fleet_membership.py): instances added, drained,
marked unhealthy and removed; what each does to placement and to the books."""

from __future__ import annotations

import pytest

from config.settings import InstanceSettings, Role
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RejectReason
from tests.routing.fleet import hold, make_conductor, prompt, request


def decide(c: Conductor, rid: str, blocks: tuple[int, ...], now: float = 0.0):
    req = request(rid, blocks, now=now)
    return req, c.schedule(req, now)


def test_no_healthy_instance_is_a_503_rejection() -> None:
    c = make_conductor()
    for p in ("p0", "p1", "p2"):
        c.set_health(p, False)
    _, r = decide(c, "r", prompt(1, 8))
    assert isinstance(r, Rejection)
    assert r.reason is RejectReason.NO_HEALTHY_PREFILL and r.http_status == 503
    c.set_health("p1", True)
    _, d = decide(c, "r2", prompt(1, 8))
    assert isinstance(d, Decision) and d.prefill == "p1"


def test_drained_instance_gets_no_new_work() -> None:
    c = make_conductor(policy="round_robin")
    c.drain_instance("p1")
    chosen = {decide(c, f"r{i}", prompt(i, 8))[1].prefill for i in range(6)}
    assert chosen == {"p0", "p2"}


def test_failure_and_instance_removal_clear_the_books() -> None:
    c = make_conductor()
    for i in range(4):
        req, d = decide(c, f"r{i}", prompt(i, 32))
        assert isinstance(d, Decision)
        c.dispatched(d, req, 0.0)
    c.failed("r0", 0.1)
    assert "r0" not in c.requests
    victim = c.requests["r1"].decision.decode
    affected = c.remove_instance(victim, 0.2)
    assert "r1" in affected or c.requests["r1"].decision.decode != victim
    for rid in affected:
        assert rid not in c.requests
    for rid in list(c.requests):
        c.finished(rid, 1.0)
    for inst in c.instances.values():
        assert inst.idle and inst.queue_time(1.0) == 0.0 and inst.reserved_tokens == 0


def test_an_added_instance_takes_work_and_a_duplicate_id_is_refused() -> None:
    c = make_conductor(policy="round_robin")
    spec = InstanceSettings(id="p9", url="http://127.0.0.1:9", role=Role.PREFILL)
    inst = c.add_instance(spec)
    assert "p9" in c.index and inst.bit_order == max(i.bit_order for i in c.instances.values())
    chosen = {decide(c, f"r{i}", prompt(i, 8))[1].prefill for i in range(8)}
    assert "p9" in chosen
    with pytest.raises(ValueError, match="already exists"):
        c.add_instance(spec)


def test_a_removed_instance_leaves_the_kv_view() -> None:
    c = make_conductor()
    hold(c, "p1", prompt(7, 100))
    assert c.index.match(prompt(7, 100), 0.0).local("p1") == 100
    c.remove_instance("p1", 1.0)
    assert "p1" not in c.index and "p1" not in c.instances
    _, d = decide(c, "r", prompt(7, 100), now=1.0)
    assert isinstance(d, Decision) and d.prefill != "p1" and d.cached_tokens == 0
