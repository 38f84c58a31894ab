"""Replication bounds and failure handling of the hot-spot planner."""

from __future__ import annotations

from config.settings import ReplicationSettings
from routing.conductor import Conductor
from routing.hotspot import HotspotPlanner
from routing.types import Decision, ReplicationReason
from tests.routing.fleet import busy, fleet_settings, hold, prompt, request


def planner(**kw) -> HotspotPlanner:
    return HotspotPlanner(ReplicationSettings(**kw), block_size=16)


def test_in_flight_caps_total_and_per_destination() -> None:
    p = planner(max_in_flight=3, max_in_flight_per_destination=2)
    req = request("r", prompt(1, 8))
    assert p.reactive(req, "a", "x", 0, 8, 0.0) is not None
    assert p.can_issue("x")
    p.reactive(request("r2", prompt(2, 8)), "a", "x", 0, 8, 0.0)
    assert not p.can_issue("x") and p.can_issue("y")
    p.reactive(request("r3", prompt(3, 8)), "a", "y", 0, 8, 0.0)
    assert not p.can_issue("z")  # total cap


def test_no_duplicate_copy_of_the_same_prefix_to_the_same_destination() -> None:
    p = planner()
    req = request("r", prompt(1, 8))
    assert p.reactive(req, "a", "x", 0, 8, 0.0) is not None
    assert p.reactive(request("r2", prompt(1, 8)), "a", "x", 0, 8, 0.1) is None
    assert len(p.in_flight) == 1


def test_pulls_into_names_other_requests_pulls_that_carry_the_counted_blocks() -> None:
    p = planner()
    blocks = prompt(1, 8)
    mine = p.reactive(request("a", blocks), "src", "x", 2, 8, 0.0)  # pulls blocks 2..7
    assert mine is not None and mine.block_hashes == blocks[2:8]
    elsewhere = p.reactive(request("c", prompt(2, 8)), "src", "y", 0, 8, 0.0)
    assert elsewhere is not None
    b = request("b", blocks)
    assert p.pulls_into("x", b, 6 * 16) == (mine.command_id,)
    assert p.pulls_into("x", request("a", blocks), 6 * 16) == ()  # its own pull: no wait
    assert p.pulls_into("x", b, 2 * 16) == ()  # counts only what x already had
    assert p.pulls_into("x", b, 0) == ()
    assert p.pulls_into("x", request("b", prompt(2, 8)), 8 * 16) == ()  # another prefix
    assert p.pulls_into("y", b, 8 * 16) == ()  # the pull to y carries other blocks
    p.complete(mine.command_id, ok=True, now=1.0)
    assert p.pulls_into("x", b, 6 * 16) == ()  # landed


def test_access_rate_decays_with_half_life() -> None:
    from routing.types import PrefixMatch

    p = planner(rate_half_life_s=10.0, min_prefix_blocks=1)
    req = request("r", prompt(1, 8))
    m = PrefixMatch({"a": 8}, {"a": 8}, 0, 8, ("a",))
    for i in range(100):
        p.observe(req, m, i * 0.1)  # 10 requests/s for 10 s
    r = p.rate(req.block_hashes[7], 9.9)
    assert 4.0 < r < 10.0  # approaching 10/s, lagging by the averaging window
    assert p.rate(req.block_hashes[7], 19.9) < r * 0.55  # one half-life later


def test_failed_copy_is_retried_at_most_max_retries_then_dropped() -> None:
    p = planner(max_retries=2)
    cmd = p.reactive(request("r", prompt(1, 8)), "a", "x", 0, 8, 0.0)
    r1 = p.complete(cmd.command_id, ok=False, now=1.0)
    r2 = p.complete(r1.command_id, ok=False, now=2.0)
    assert r1 is not None and r2 is not None and r2.block_hashes == cmd.block_hashes
    assert p.complete(r2.command_id, ok=False, now=3.0) is None
    assert not p.in_flight and p.can_issue("x") and p.failed == 3


def test_timed_out_copy_counts_as_failed() -> None:
    p = planner(timeout_s=5.0, max_retries=0)
    p.reactive(request("r", prompt(1, 8)), "a", "x", 0, 8, 0.0)
    assert p.expire(4.0) == [] and len(p.in_flight) == 1
    assert p.expire(6.0) == [] and not p.in_flight


def _pull(c: Conductor) -> Decision:
    hold(c, "p0", prompt(7, 200))
    busy(c, "p0", 5.0)
    busy(c, "p2", 5.0)
    req = request("r", prompt(7, 256))
    d = c.schedule(req, 0.0)
    assert isinstance(d, Decision) and d.pull_source == "p0"
    return d


def test_failed_copy_leaves_the_index_unchanged() -> None:
    c = Conductor(fleet_settings(replication=ReplicationSettings(max_retries=0)))
    d = _pull(c)
    (cmd,) = d.replications
    assert c.replication_done(cmd.command_id, ok=False, now=1.0) is None
    assert c.index.match(prompt(7, 256), 1.0).local("p1") == 0


def test_confirmed_copy_updates_the_index() -> None:
    c = Conductor(fleet_settings())
    d = _pull(c)
    (cmd,) = d.replications
    assert cmd.reason is ReplicationReason.REACTIVE
    c.replication_done(cmd.command_id, ok=True, now=1.0)
    assert c.index.match(prompt(7, 256), 1.0).local("p1") == 200
    assert c.planner.confirmed == 1 and not c.planner.in_flight


def test_pull_falls_back_to_recompute_when_destination_is_at_its_cap() -> None:
    rep = ReplicationSettings(max_in_flight_per_destination=1)
    c = Conductor(fleet_settings(replication=rep))
    c.planner.reactive(request("x", prompt(9, 8)), "p2", "p1", 0, 8, 0.0)  # p1 is full
    hold(c, "p0", prompt(7, 200))
    busy(c, "p0", 5.0)
    busy(c, "p2", 5.0)
    d = c.schedule(request("r", prompt(7, 256)), 0.0)
    assert isinstance(d, Decision)
    assert d.prefill == "p1" and d.pull_source is None and d.cached_tokens == 0


def test_cooldowns_stay_bounded(monkeypatch) -> None:
    """Each issued copy starts a cooldown for its prefix; expired ones are dropped once the
    table reaches its bound, so a long run does not keep one entry per prefix ever copied."""
    import routing.hotspot as hotspot

    monkeypatch.setattr(hotspot, "_MAX_TRACKED_PREFIXES", 4)
    p = planner(max_in_flight=100, max_in_flight_per_destination=100, cooldown_s=1.0)
    for i in range(10):
        cmd = p.reactive(request(f"r{i}", prompt(i, 8)), "a", "x", 0, 8, 10.0 * i)
        assert cmd is not None
        p.complete(cmd.command_id, True, 10.0 * i)
    assert len(p._cooldown_until) <= 4
