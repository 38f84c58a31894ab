"""Mooncake Algorithm 1 behaviour, pinned by small scenarios on a real Conductor."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.settings import AdmissionMode, ReplicationSettings
from routing.conductor import Conductor
from routing.types import BlockRemoved, Decision, Rejection, RejectReason, ReplicationReason
from tests.routing.fleet import busy, fleet_settings, hold, make_conductor, prompt, request


def decide(c: Conductor, rid: str, blocks: tuple[int, ...], now: float = 0.0, **kw):
    req = request(rid, blocks, now=now, **kw)
    return req, c.schedule(req, now)


def pull_scenario() -> Conductor:
    """p0 holds a 200-block prefix but is 5 s behind, p2 is busy too, p1 idle."""
    c = make_conductor()
    hold(c, "p0", prompt(7, 200))
    busy(c, "p0", 5.0)
    busy(c, "p2", 5.0)
    return c


def test_prefers_the_holder_when_its_queue_is_short() -> None:
    c = make_conductor()
    hold(c, "p1", prompt(7, 200))
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision)
    assert d.prefill == "p1"
    assert d.reason == "local_prefix"
    assert d.cached_tokens == 200 * 16
    assert d.pull_source is None and d.replications == ()
    # Reusing 200 of 256 blocks must be predicted much faster than recomputing everything.
    cold = c.instances["p0"]
    assert d.predicted_ttft_s < cold.predictors.prefill.predict(256 * 16, 0) / 2


def test_pulls_the_prefix_to_an_idle_instance_when_that_beats_waiting() -> None:
    c = pull_scenario()
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision)
    assert d.prefill == "p1"
    assert d.reason == "pull_prefix"
    assert d.pull_source == "p0"
    assert d.predicted_transfer_s > 0
    assert d.predicted_ttft_s < 5.0
    # The pull is issued as a reactive replication command holder -> chosen instance.
    (cmd,) = [r for r in d.replications if r.reason is ReplicationReason.REACTIVE]
    assert (cmd.source, cmd.destination) == ("p0", "p1")
    assert cmd.block_hashes == prompt(7, 200)
    assert cmd.request_id == "r"


def test_a_request_counting_on_another_requests_pull_waits_for_it_to_land() -> None:
    c = pull_scenario()
    req_a, a = decide(c, "a", prompt(7, 256))
    assert isinstance(a, Decision) and (a.prefill, a.pull_source) == ("p1", "p0")
    assert a.waits_for == ()  # its own pull is in replications
    c.dispatched(a, req_a, 0.0)  # books a's whole prompt at p1, pulled part included
    _, b = decide(c, "b", prompt(7, 250), now=0.01)
    assert isinstance(b, Decision) and b.prefill == "p1" and b.pull_source is None
    (pull,) = a.replications
    assert b.waits_for == (pull.command_id,)
    # While it is on the wire, a prompt that shares none of the pulled blocks does not wait.
    hold(c, "p1", prompt(8, 64))
    _, other = decide(c, "o", prompt(8, 64), now=0.02)
    assert isinstance(other, Decision) and other.prefill == "p1" and other.waits_for == ()
    c.replication_done(pull.command_id, True, 0.5)  # landed: nothing left to wait for
    _, b2 = decide(c, "b2", prompt(7, 250), now=0.6)
    assert isinstance(b2, Decision) and b2.prefill == "p1" and b2.waits_for == ()


def test_waits_for_the_holder_when_the_transfer_costs_more_than_the_wait() -> None:
    # A slow link (0.01 Gb/s) makes pulling 200 blocks far slower than a short queue.
    c = Conductor(
        fleet_settings(predictors=replace(fleet_settings().predictors, link_bandwidth_gbps=0.01))
    )
    hold(c, "p0", prompt(7, 200))
    busy(c, "p0", 0.05)
    busy(c, "p2", 5.0)
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision)
    assert d.prefill == "p0" and d.pull_source is None


def test_recomputes_locally_when_the_remote_prefix_is_not_better_by_the_threshold() -> None:
    c = make_conductor()
    hold(c, "p0", prompt(7, 100))
    hold(c, "p1", prompt(7, 80))  # 100 / 80 = 1.25 < threshold 1.5
    busy(c, "p0", 5.0)
    busy(c, "p2", 5.0)
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision)
    assert d.prefill == "p1"
    assert d.pull_source is None
    assert d.cached_tokens == 80 * 16
    assert d.replications == ()


def test_pulls_when_the_remote_prefix_beats_the_threshold() -> None:
    c = make_conductor()
    hold(c, "p0", prompt(7, 200))
    hold(c, "p1", prompt(7, 80))  # 200 / 80 = 2.5 >= 1.5
    busy(c, "p0", 5.0)
    busy(c, "p2", 5.0)
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision)
    assert (d.prefill, d.pull_source) == ("p1", "p0")
    (cmd,) = d.replications
    assert cmd.block_hashes == prompt(7, 200)[80:]  # only what p1 lacks


def test_rejects_when_every_option_breaks_the_ttft_slo() -> None:
    c = make_conductor(admission=AdmissionMode.EARLY)
    for p in ("p0", "p1", "p2"):
        busy(c, p, 40.0)  # every queue is beyond the 30 s SLO
    _, r = decide(c, "r", prompt(1, 64))
    assert isinstance(r, Rejection)
    assert r.reason is RejectReason.TTFT_SLO
    assert r.http_status == 429
    assert r.predicted_ttft_s is not None and r.predicted_ttft_s > 40.0
    assert r.limit_s == pytest.approx(30.0 * 0.9)  # "normal" keeps 10 % headroom
    assert "TTFT" in r.message and "ms" in r.message
    assert 1.0 <= r.retry_after_s <= 60.0
    assert c.stats.rejections == {"ttft_slo": 1}


def test_admission_none_never_rejects_for_slo() -> None:
    c = make_conductor(admission=AdmissionMode.NONE)
    for p in ("p0", "p1", "p2"):
        busy(c, p, 40.0)
    _, d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision)
    assert d.predicted_ttft_s > 30.0


def test_emits_proactive_replication_for_a_hot_prefix_on_busy_holders() -> None:
    rep = ReplicationSettings(hot_rate_per_s=0.05, holder_queue_threshold_s=1.0, cooldown_s=100.0)
    c = Conductor(fleet_settings(prefill=4, policy="cache_aware", replication=rep))
    hold(c, "p0", prompt(3, 128))
    busy(c, "p0", 2.0)  # the only holder is the bottleneck
    cmds = []
    for i in range(5):
        _, d = decide(c, f"r{i}", prompt(3, 128) + prompt(100 + i, 8), now=0.01 * i)
        assert isinstance(d, Decision)
        cmds += [r for r in d.replications if r.reason is ReplicationReason.PROACTIVE]
    assert len(cmds) == 1, "cool-down allows one copy per prefix"
    cmd = cmds[0]
    assert cmd.source == "p0" and cmd.destination != "p0"
    assert cmd.block_hashes == prompt(3, 128)


def test_no_replication_to_an_instance_that_already_holds_the_prefix() -> None:
    rep = ReplicationSettings(hot_rate_per_s=0.0, holder_queue_threshold_s=0.5)
    c = Conductor(fleet_settings(prefill=2, policy="cache_aware", replication=rep))
    hold(c, "p0", prompt(3, 64))
    hold(c, "p1", prompt(3, 64))
    busy(c, "p0", 2.0)
    busy(c, "p1", 2.0)
    _, d = decide(c, "r", prompt(3, 64) + prompt(9, 4))
    assert isinstance(d, Decision)
    assert d.replications == ()


def test_lower_priority_is_shed_first() -> None:
    c = make_conductor(admission=AdmissionMode.EARLY)
    for p in ("p0", "p1", "p2"):
        busy(c, p, 24.0)  # predicted TTFT ~24 s: inside 30 s, outside low's 70 % budget
    _, high = decide(c, "h", prompt(1, 8), priority="high")
    _, low = decide(c, "l", prompt(1, 8), priority="low")
    assert isinstance(high, Decision)
    assert isinstance(low, Rejection) and low.priority == "low"
    assert "headroom" in low.message


def test_per_request_slo_override_is_clamped_to_operator_limits() -> None:
    c = make_conductor(admission=AdmissionMode.NONE)
    _, d = decide(c, "r", prompt(1, 8), slo_ttft_s=1000.0, slo_tbt_s=0.0001)
    assert isinstance(d, Decision)
    assert d.slo_ttft_s == 120.0  # max_ttft_s
    assert d.slo_tbt_s == 0.005  # min_tbt_s


def test_books_return_to_zero_after_the_request_lifecycle() -> None:
    c = make_conductor()
    req, d = decide(c, "r", prompt(1, 64))
    assert isinstance(d, Decision)
    c.dispatched(d, req, 0.0)
    p, dec = c.instances[d.prefill], c.instances[d.decode]
    assert p.queue_time(0.0) == pytest.approx(d.predicted_prefill_s)
    assert dec.incoming and dec.batch == 0
    c.prefill_done("r", 0.1)
    assert p.queue_time(0.1) == 0.0 and dec.batch == 1
    assert dec.context_tokens == 64 * 16
    ttft = c.first_token("r", 0.12)
    assert ttft == pytest.approx(0.12)
    c.tokens("r", 10, 0.2)
    assert dec.context_tokens == 64 * 16 + 10
    c.finished("r", 0.5, output_tokens=11)
    assert (dec.batch, dec.context_tokens, dec.reserved_tokens) == (0, 0, 0)
    assert p.idle and dec.idle and not c.requests
    # What the gateway routed is now in the cache view (predict-on-route).
    assert c.index.match(prompt(1, 64), 1.0).local(d.prefill) == 64


def test_colocated_pool_decodes_where_it_prefills() -> None:
    c = make_conductor(prefill=0, decode=0, colocated=3, policy="least_load")
    req, d = decide(c, "r", prompt(1, 16))
    assert isinstance(d, Decision)
    assert d.prefill == d.decode
    c.dispatched(d, req, 0.0)
    c.prefill_done("r", 0.05)
    assert c.instances[d.decode].batch == 1


def test_same_seed_same_decisions() -> None:
    def run() -> list[tuple[str, str]]:
        c = make_conductor(policy="random")
        out = []
        for i in range(30):
            req, d = decide(c, f"r{i}", prompt(i % 4, 16), now=i * 0.01)
            c.dispatched(d, req, i * 0.01)
            out.append((d.prefill, d.decode))
        return out

    assert run() == run()


def test_live_settings_change_applies_without_rebuilding_state() -> None:
    c = make_conductor(admission=AdmissionMode.NONE)
    for p in ("p0", "p1", "p2"):
        busy(c, p, 40.0)
    assert isinstance(decide(c, "a", prompt(1, 8))[1], Decision)
    c.apply_settings(
        replace(c.settings, admission=replace(c.settings.admission, mode=AdmissionMode.EARLY))
    )
    assert isinstance(decide(c, "b", prompt(1, 8))[1], Rejection)
    assert c.instances["p0"].queue_time(0.0) == pytest.approx(40.0)


def test_a_withdrawn_decision_counts_as_a_rejection_and_releases_its_copies() -> None:
    # The pull scenario above: the decision carries a reactive replication command.
    c = pull_scenario()
    _, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision) and d.replications
    assert c.stats.decisions == 1 and c.planner.in_flight
    turned_away = Rejection("r", RejectReason.TTFT_SLO, "over its fair share", 1.0)
    c.withdraw(d, turned_away)
    assert c.stats.decisions == 0 and c.stats.replications == 0
    assert c.stats.rejections == {"ttft_slo": 1}
    assert not c.planner.in_flight  # the copy's in-flight slot is free again
    assert c.requests == {}


def test_swap_prefill_model_changes_only_that_profiles_instances() -> None:
    from predictors.prefill import AnalyticPrefill

    c = make_conductor()
    before = {iid: inst.predictors for iid, inst in c.instances.items()}
    model = AnalyticPrefill(fixed_s=0.001, per_token_s=1e-5, knee_tokens=0, attn_s=0.0)
    assert c.swap_prefill_model("no-such-profile", model) == 0
    assert {iid: inst.predictors for iid, inst in c.instances.items()} == before
    profile = next(iter(c.instances.values())).predictors.profile.name
    assert c.swap_prefill_model(profile, model) == len(c.instances)
    bundles = {id(inst.predictors) for inst in c.instances.values()}
    assert all(inst.predictors.prefill is model for inst in c.instances.values())
    assert len(bundles) <= len({id(b) for b in before.values()})  # shared bundles stay shared


def test_listeners_run_before_every_judgement_and_after_every_dispatch() -> None:
    c = make_conductor()
    calls: list[str] = []
    c.before_schedule.append(lambda: calls.append("before"))
    c.after_dispatch.append(lambda: calls.append("after"))
    req = request("r1", prompt(1, 64), now=0.0)
    c.reject_hopeless(req, 0.0)  # the fast check sees the same view as schedule
    d = c.schedule(req, 0.0)
    assert isinstance(d, Decision)
    c.dispatched(d, req, 0.0)
    assert calls == ["before", "before", "after"]


def test_an_evicted_prefix_lengthens_the_queue_behind_its_request() -> None:
    c = make_conductor()
    hold(c, "p0", prompt(7, 200))
    for inst in ("p0", "p1", "p2"):
        busy(c, inst, 2.0)  # the request waits: the engine has not matched its prefix yet
    req, d = decide(c, "r", prompt(7, 256))
    assert isinstance(d, Decision) and d.prefill == "p0" and d.cached_tokens == 200 * 16
    c.dispatched(d, req, 0.0)
    behind, d2 = decide(c, "s", prompt(8, 32))
    assert isinstance(d2, Decision)
    d2.prefill = "p0"  # pinned behind r, to watch it move
    c.dispatched(d2, behind, 0.0)
    p0 = c.instances["p0"]
    before_s = p0.prefill_queue["s"].est_start_s
    queue = p0.queue_time(0.5)

    c.kv_event("p0", BlockRemoved(prompt(9, 5)), 0.5)  # someone else's blocks: nothing moves
    assert p0.queue_time(0.5) == pytest.approx(queue)
    c.kv_event("p0", BlockRemoved(prompt(7, 100, start=100)), 0.5)  # the second half of r's

    predict = p0.predictors.prefill.predict
    extra = predict(156 * 16, 100 * 16) - predict(56 * 16, 200 * 16)
    assert extra > 0.01
    assert p0.queue_time(0.5) == pytest.approx(queue + extra)
    assert p0.prefill_queue["s"].est_start_s == pytest.approx(before_s + extra)
    # Once the engine has started r's prefill it has matched its prefix: nothing moves.
    p0.finish_prefill("filler-p0-2.0", 2.0)
    started = p0.queue_time(2.01)
    c.kv_event("p0", BlockRemoved(prompt(7, 100)), 2.01)
    assert p0.queue_time(2.01) == pytest.approx(started) == pytest.approx(queue + extra - 1.51)
