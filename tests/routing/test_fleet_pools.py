"""The eligible pools per model, rebuilt on fleet changes."""

from __future__ import annotations

from routing.fleet_pools import FleetPools, least_loaded
from tests.routing.fleet import make_conductor


def test_pools_follow_health_and_drain_in_registration_order() -> None:
    c = make_conductor(prefill=3, decode=2)
    pools = c.pools.for_model(None)
    assert [i.id for i in pools.prefill] == ["p0", "p1", "p2"]
    assert [i.id for i in pools.decode] == ["d0", "d1"] and pools.has_decode_pool
    c.set_health("p1", False)
    c.drain_instance("d0")
    pools = c.pools.for_model(None)
    assert [i.id for i in pools.prefill] == ["p0", "p2"]
    assert [i.id for i in pools.decode] == ["d1"]
    c.drain_instance("d1")
    # No eligible decode instance left, but a decode pool exists: not a colocated fleet.
    assert c.pools.for_model(None).decode == [] and c.pools.for_model(None).has_decode_pool


def test_colocated_fleet_and_unknown_model() -> None:
    c = make_conductor(prefill=0, decode=0, colocated=2)
    pools = c.pools.for_model(None)
    assert [i.id for i in pools.prefill] == ["c0", "c1"] and not pools.has_decode_pool
    # Instances without a model are filed under None; a named model with none is empty.
    assert c.pools.for_model("other").prefill == []
    assert FleetPools().for_model(None).prefill == []


def test_rotation_starts_each_pool_at_its_position_and_wraps() -> None:
    c = make_conductor(prefill=3, decode=2)
    c.rotate_ties(4)
    pools = c.pools.for_model(None)
    assert [i.id for i in pools.prefill] == ["p1", "p2", "p0"]  # 4 mod 3
    assert [i.id for i in pools.decode] == ["d0", "d1"]  # 4 mod 2
    c.set_health("p0", False)  # kept through fleet changes, over the eligible ones
    assert [i.id for i in c.pools.for_model(None).prefill] == ["p1", "p2"]  # 4 mod 2


def test_rotation_leaves_the_policys_grouping_in_registration_order() -> None:
    c = make_conductor(prefill=0, decode=0, colocated=3)
    seen: list[list[str]] = []
    c.policy.on_fleet_change = lambda insts, now: seen.append([i.id for i in insts])  # type: ignore[method-assign]
    c.rotate_ties(1)
    assert [i.id for i in c.pools.for_model(None).prefill] == ["c1", "c2", "c0"]
    assert seen[-1] == ["c0", "c1", "c2"]


def test_least_loaded_is_the_shortest_queue_then_the_fleet_order() -> None:
    c = make_conductor(prefill=3, decode=0)
    p0, p1, p2 = (c.instances[i] for i in ("p0", "p1", "p2"))
    assert least_loaded([p2, p1, p0], 0.0) is p0  # all idle: the fleet's order
    p0.enqueue_prefill("q", 1.0, 900, now=0.0, ready_s=0.0)
    assert least_loaded([p0, p1, p2], 0.0) is p1
    assert least_loaded([], 0.0) is None
