"""rolling_activation (EcoServe PaDG) scenarios through the real Conductor and settings."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest

from config.settings import InstanceSettings, Role, frozen_mapping
from routing.conductor import Conductor
from routing.policies.ecoserve import RollingActivationPolicy
from routing.policies.registry import build_policy
from routing.types import Decision
from tests.routing.fleet import fleet_settings, prompt, request

BIG = 512  # blocks of 16 tokens: an 8192-token prompt, ~0.2 s of prefill (llama3-8b/H100)


def eco(colocated: int = 4, ttft: float = 30.0, tbt: float = 0.1, **params: object) -> Conductor:
    s = fleet_settings(prefill=0, decode=0, colocated=colocated, policy="rolling_activation")
    s = replace(
        s,
        slo=replace(s.slo, ttft_s=ttft, tbt_s=tbt),
        routing=replace(s.routing, params=frozen_mapping(params)),
    )
    return Conductor(s)


def policy(c: Conductor) -> RollingActivationPolicy:
    assert isinstance(c.policy, RollingActivationPolicy)
    return c.policy


def go(c: Conductor, rid: str, blocks: int, now: float) -> Decision:
    req = request(rid, prompt(zlib.crc32(rid.encode()), blocks), now=now)
    d = c.schedule(req, now)
    assert isinstance(d, Decision), d
    c.dispatched(d, req, now)
    return d


def actives(c: Conductor, now: float) -> list[str]:
    return [m["active"] for m in policy(c).macro_instances(now)]


def books(c: Conductor) -> dict[str, tuple]:
    return {
        iid: (
            tuple(i.prefill_queue),
            tuple(i.incoming),
            tuple(i.running),
            i.reserved_tokens,
            i.batch,
        )
        for iid, i in c.instances.items()
    }


# ---------------------------------------------------------------- CheckConstraints


def test_ttft_constraint_moves_on_when_the_window_is_full() -> None:
    c = eco(ttft=1.0, macro_size=4)
    chosen = [go(c, f"r{i}", BIG, 0.0).prefill for i in range(8)]
    k = chosen.count("c0")
    # The window of c0 holds what finishes within 1 s, then the next member takes over.
    assert 2 <= k <= 5 and chosen[:k] == ["c0"] * k and chosen[k] == "c1"
    assert policy(c).moves["ttft"] >= 1 and set(policy(c).moves) == {"ttft"}


def test_tpot_constraint_moves_on_when_running_decodes_have_no_slack() -> None:
    # slack_credit 0: only the slack saved so far counts (EcoServe's own rule).
    c = eco(ttft=30.0, tbt=0.1, macro_size=4, slack_credit=0.0)
    for i in range(4):
        assert go(c, f"d{i}", 4, 0.0).prefill == "c0"
    for i in range(4):
        c.prefill_done(f"d{i}", 0.1)
        # 100 tokens in 9.9 s at a 100 ms TPOT SLO: 0.1 s of slack saved.
        c.tokens(f"d{i}", 100, 10.0)
    d = go(c, "big", 2 * BIG, 10.0)  # ~0.45 s of prefill stalls them past the SLO
    assert d.prefill == "c1"
    assert dict(policy(c).moves) == {"tpot": 1}
    # With plenty of slack saved, the same request stays on the active member.
    c2 = eco(ttft=30.0, tbt=0.1, macro_size=4, slack_credit=0.0)
    for i in range(4):
        go(c2, f"d{i}", 4, 0.0)
        c2.prefill_done(f"d{i}", 0.1)
        c2.tokens(f"d{i}", 100, 5.0)  # 5 s saved
    assert go(c2, "big", 2 * BIG, 5.0).prefill == "c0"


def test_kv_constraint_moves_on_when_the_prompt_does_not_fit() -> None:
    c = eco(macro_size=4)
    c.instances["c0"].capacity_tokens = 5000
    assert go(c, "a", 256, 0.0).prefill == "c0"  # 4096 + 128 predicted output fit
    assert go(c, "b", 256, 0.0).prefill == "c1"
    assert dict(policy(c).moves) == {"kv": 1}


def test_without_a_passing_instance_the_least_violating_is_taken() -> None:
    c = eco(ttft=0.05, macro_size=4)  # nothing of 8192 tokens can meet a 50 ms TTFT
    d = go(c, "a", BIG, 0.0)
    assert d.prefill == "c0"  # all equal: the active member (no needless switch)
    d = go(c, "b", BIG, 0.0)
    assert d.prefill != "c0"  # c0's queue makes it the worst now


# ---------------------------------------------------------------- activation windows


def test_an_instance_in_its_decode_phase_receives_no_new_prefill() -> None:
    c = eco(colocated=6, ttft=1.0, macro_size=3)
    t = 0.0
    for i in range(60):
        before = {m["active"] for m in policy(c).macro_instances(t)}
        switches = policy(c).switches
        d = go(c, f"r{i}", BIG // 2, t)
        after = policy(c).macro_instances(t)
        # Every macro instance has exactly one member in its prefill phase ...
        for m in after:
            phases = [x["phase"] for x in m["instances"]]
            assert phases.count("prefill") == 1
        # ... and the prefill went to an active member, or to the member that just took over.
        assert d.prefill in before or policy(c).switches == switches + 1
        assert d.prefill in {m["active"] for m in after}
        if i % 3 == 2:  # some prefills finish and decode on
            for rid, rec in list(c.requests.items()):
                if rec.prefill_done_s is None and rid != d.request_id:
                    c.prefill_done(rid, t)
                    break
        t += 0.05


def test_windows_roll_through_the_cycle() -> None:
    c = eco(colocated=4, ttft=0.6, macro_size=4)
    seen = []
    for i in range(40):
        d = go(c, f"r{i}", BIG, i * 0.01)
        if not seen or seen[-1] != d.prefill:
            seen.append(d.prefill)
    assert seen[:5] == ["c0", "c1", "c2", "c3", "c0"]


def test_select_decode_is_the_prefill_instance() -> None:
    c = eco(colocated=4, macro_size=2)
    d = go(c, "a", 8, 0.0)
    assert d.decode == d.prefill


# ---------------------------------------------------------------- mitosis


def test_layout_groups_the_fleet_into_macro_instances() -> None:
    c = eco(colocated=8, macro_size=4)
    view = policy(c).macro_instances(0.0)
    assert [m["members"] for m in view] == [["c0", "c1", "c2", "c3"], ["c4", "c5", "c6", "c7"]]
    assert actives(c, 0.0) == ["c0", "c4"]
    assert view[0]["instances"][1]["phase"] == "decode"


def test_split_and_merge_keep_every_in_flight_request() -> None:
    c = eco(colocated=4, ttft=0.5, macro_size=2, min_macro=1, max_macro=3)
    for i in range(16):
        go(c, f"r{i}", 64, i * 0.01)
    for i in range(0, 16, 2):
        c.prefill_done(f"r{i}", 0.5)  # half decode, half still queued
    c.tokens("r0", 5, 0.6)
    ids, before = set(c.requests), books(c)
    assert [m["members"] for m in policy(c).macro_instances(1.0)] == [["c0", "c1"], ["c2", "c3"]]

    for n in (4, 5, 6):  # grow: fill both to max_macro, then the last one splits
        c.add_instance(InstanceSettings(f"c{n}", f"http://127.0.0.1:{9400 + n}", Role.BOTH))
    groups = [m["members"] for m in policy(c).macro_instances(1.0)]
    assert sorted(len(g) for g in groups) == [1, 3, 3] and len(groups) == 3
    assert sorted(m for g in groups for m in g) == [f"c{i}" for i in range(7)]
    assert set(c.requests) == ids
    assert {k: v for k, v in books(c).items() if k in before} == before

    # shrink: a removed instance's requests fail (as today); nobody else's books change
    victim = next(iid for iid in ("c0", "c1", "c2", "c3") if c.instances[iid].running)
    dropped = set(c.remove_instance(victim, 1.0))
    assert dropped and set(c.requests) == ids - dropped
    after = books(c)
    assert {k: v for k, v in after.items() if k in before} == {
        k: v for k, v in before.items() if k != victim
    }
    for iid in [m for m in policy(c).macros.members() if m != victim][:4]:
        if len(policy(c).macros.groups) == 1:
            break
        if not c.instances[iid].running and not c.instances[iid].prefill_queue:
            c.remove_instance(iid, 1.1)
    members = policy(c).macros.members()
    assert sorted(members) == sorted(c.instances)
    assert all(1 <= len(g.members) <= 3 for g in policy(c).macros.groups)
    for rid in c.requests:  # every surviving request is still on a member instance
        rec = c.requests[rid]
        assert rec.decision.prefill in c.instances
    # scheduling goes on over the new layout
    assert go(c, "after", 8, 2.0).prefill in members


def test_removal_below_the_bound_merges_with_a_neighbour() -> None:
    c = eco(colocated=6, macro_size=3, min_macro=2, max_macro=4)
    assert [len(m["members"]) for m in policy(c).macro_instances(0.0)] == [3, 3]
    go(c, "a", 8, 0.0)  # traffic seen: mitosis from now on
    c.remove_instance("c1", 0.1)  # 2 + 3 > 4: no merge
    assert [len(m["members"]) for m in policy(c).macro_instances(0.1)] == [2, 3]
    c.remove_instance("c4", 0.2)  # 2 + 2 <= 4: merge
    view = policy(c).macro_instances(0.2)
    assert [m["members"] for m in view] == [["c0", "c2", "c3", "c5"]]
    assert view[0]["active"] == "c0"


def test_removing_the_active_member_hands_over_to_the_next() -> None:
    c = eco(colocated=4, macro_size=4)
    go(c, "a", 8, 0.0)
    c.remove_instance("c0", 1.0)
    assert actives(c, 1.0) == ["c1"]
    assert go(c, "b", 8, 1.0).prefill == "c1"


def test_drained_and_unhealthy_instances_leave_and_come_back() -> None:
    c = eco(colocated=4, macro_size=4)
    go(c, "a", 8, 0.0)
    c.drain_instance("c2")
    assert "c2" not in policy(c).macros.members()
    c.set_health("c3", False)
    assert policy(c).macros.members() == ["c0", "c1"]
    c.drain_instance("c2", draining=False)
    c.set_health("c3", True)
    assert sorted(policy(c).macros.members()) == ["c0", "c1", "c2", "c3"]


# ---------------------------------------------------------------- misc


def test_same_inputs_same_decisions() -> None:
    def run() -> tuple[list[str], list]:
        c = eco(colocated=6, ttft=1.0, macro_size=3)
        out = []
        for i in range(50):
            out.append(go(c, f"r{i}", 64 + (i * 37) % 400, i * 0.03).prefill)
            if i % 4 == 0:
                c.prefill_done(f"r{i}", i * 0.03)
        return out, policy(c).macro_instances(2.0)

    assert run() == run()


def test_parameters_are_validated() -> None:
    with pytest.raises(ValueError):
        build_policy("rolling_activation", {"macro_size": 2, "min_macro": 3})
    with pytest.raises(ValueError):
        build_policy("rolling_activation", {"min_macro": 3, "macro_size": 4, "max_macro": 4})
    p = build_policy("rolling_activation", {"macro_size": 2, "max_window_s": 1.0})
    assert isinstance(p, RollingActivationPolicy) and p.max_window_s == 1.0


def test_a_disaggregated_pool_falls_back_to_the_shortest_queue() -> None:
    s = fleet_settings(prefill=2, decode=1, policy="rolling_activation")
    c = Conductor(s)
    req = request("a", prompt(1, 8))
    d = c.schedule(req, 0.0)
    assert isinstance(d, Decision) and d.prefill == "p0" and d.decode == "d0"
