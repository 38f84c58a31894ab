"""The hopeless check never rejects what the full decision would admit, and does reject when
even the shortest queue misses the TTFT SLO."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config.settings import AdmissionMode
from routing.conductor import Conductor
from routing.policies.registry import POLICIES
from routing.types import Decision, Rejection, RejectReason, RequestInfo
from tests.routing.fleet import busy, fleet_settings, hold, make_conductor, prompt, request


def _head(rid: str, slo_ttft_s: float | None = None, **kw: object) -> RequestInfo:
    """What the gateway knows before tokenizing: no tokens, no blocks."""
    return RequestInfo(rid, 0, (), 16, 0.0, slo_ttft_s=slo_ttft_s, **kw)  # type: ignore[arg-type]


def _conductor(mode: AdmissionMode, **routing: object) -> Conductor:
    s = fleet_settings(prefill=2, decode=1, admission=mode)
    if routing:
        s = replace(s, routing=replace(s.routing, **routing))
    return Conductor(s)


def test_rejects_when_every_queue_exceeds_the_slo_like_schedule_does() -> None:
    c = _conductor(AdmissionMode.EARLY)
    busy(c, "p0", 3.0)
    busy(c, "p1", 2.0)
    rej = c.reject_hopeless(_head("r1", slo_ttft_s=1.0), 0.0)
    assert isinstance(rej, Rejection)
    assert rej.reason is RejectReason.TTFT_SLO and rej.http_status == 429
    assert rej.predicted_ttft_s == 2.0  # the shortest queue
    assert c.stats.rejections == {"ttft_slo": 1}  # counted like any rejection
    full = c.schedule(request("r1", prompt(1, 64), slo_ttft_s=1.0), 0.0)
    assert isinstance(full, Rejection) and full.reason is RejectReason.TTFT_SLO
    # The same limit (the priority class's headroom applied) and class as the full answer.
    assert (rej.limit_s, rej.priority) == (full.limit_s, full.priority) == (0.9, "normal")
    assert full.predicted_ttft_s is not None and full.predicted_ttft_s >= 2.0


def test_one_short_queue_is_enough_to_decide_normally() -> None:
    c = _conductor(AdmissionMode.PREDICTIVE)
    busy(c, "p0", 3.0)
    busy(c, "p1", 0.5)
    assert c.reject_hopeless(_head("r1", slo_ttft_s=1.0), 0.0) is None
    assert c.stats.rejections == {}
    # Time passes: the queues drain, and a request once hopeless is judged again.
    assert c.reject_hopeless(_head("r2", slo_ttft_s=1.0), 2.5) is None


def test_modes_without_slo_admission_never_reject_here() -> None:
    for mode in (AdmissionMode.NONE, AdmissionMode.PEER):
        c = _conductor(mode)
        busy(c, "p0", 30.0)
        busy(c, "p1", 30.0)
        assert c.reject_hopeless(_head("r1", slo_ttft_s=0.1), 0.0) is None


def test_no_healthy_pool_is_left_to_schedule() -> None:
    c = _conductor(AdmissionMode.EARLY)
    busy(c, "p0", 30.0)
    busy(c, "p1", 30.0)
    c.set_health("d0", False)
    assert c.reject_hopeless(_head("r1", slo_ttft_s=0.1), 0.0) is None
    full = c.schedule(request("r1", prompt(1, 8), slo_ttft_s=0.1), 0.0)
    assert isinstance(full, Rejection) and full.reason is RejectReason.NO_HEALTHY_DECODE


def test_conditional_disagg_counts_the_decode_instances_queue() -> None:
    c = _conductor(AdmissionMode.EARLY, conditional_disagg=True)
    busy(c, "p0", 30.0)
    busy(c, "p1", 30.0)
    # The idle decode instance prefills a short prompt itself, in time: not hopeless.
    assert c.reject_hopeless(_head("r1", slo_ttft_s=1.0), 0.0) is None
    full = c.schedule(request("r1", prompt(1, 4), slo_ttft_s=1.0), 0.0)
    assert isinstance(full, Decision) and full.prefill == "d0"
    off = _conductor(AdmissionMode.EARLY)
    busy(off, "p0", 30.0)
    busy(off, "p1", 30.0)
    assert off.reject_hopeless(_head("r1", slo_ttft_s=1.0), 0.0) is not None


def test_margin_and_priority_headroom_apply_as_in_admission() -> None:
    c = _conductor(AdmissionMode.EARLY)
    busy(c, "p0", 0.8)
    busy(c, "p1", 0.8)
    assert c.reject_hopeless(_head("r1", slo_ttft_s=1.0), 0.0) is None
    s = c.settings
    c.apply_settings(replace(s, admission=replace(s.admission, ttft_margin=1.5)))
    rej = c.reject_hopeless(_head("r2", slo_ttft_s=1.0), 0.0)
    assert rej is not None and rej.predicted_ttft_s == 0.8


_POLICIES = sorted(POLICIES)


@st.composite
def _case(draw: st.DrawFn):
    prefill = draw(st.integers(0, 3))
    colocated = draw(st.integers(0 if prefill else 1, 3))
    decode = draw(st.integers(0, 2)) if prefill else 0
    s = fleet_settings(
        prefill=prefill,
        decode=decode,
        colocated=colocated,
        policy=draw(st.sampled_from(_POLICIES)),
        admission=draw(st.sampled_from([AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])),
    )
    s = replace(
        s,
        routing=replace(s.routing, conditional_disagg=draw(st.booleans())),
        admission=replace(s.admission, ttft_margin=draw(st.sampled_from([0.8, 1.0, 1.3]))),
    )
    ids = [i.id for i in s.instances()]
    loads = draw(
        st.lists(st.tuples(st.sampled_from(ids), st.floats(0.0, 4.0)), max_size=6),
    )
    held = draw(st.lists(st.tuples(st.sampled_from(ids), st.integers(1, 64)), max_size=3))
    unhealthy = draw(st.sets(st.sampled_from(ids), max_size=1))
    blocks = draw(st.integers(1, 300))
    slo = draw(st.sampled_from([None, 0.05, 0.2, 0.5, 1.0, 2.0, 5.0]))
    now = draw(st.floats(0.0, 3.0))
    others = draw(st.integers(0, 4))
    return s, loads, held, unhealthy, blocks, slo, now, others


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_fast_rejection_implies_the_full_schedule_rejects(case) -> None:
    s, loads, held, unhealthy, blocks, slo, now, others = case
    c = Conductor(s)
    for iid, seconds in loads:
        if c.instances[iid].does_prefill:
            busy(c, iid, seconds)
    for iid, n in held:
        if c.instances[iid].does_prefill:
            hold(c, iid, prompt(1, n))
    for k in range(others):  # real decisions load the decode side too
        d = c.schedule(request(f"o{k}", prompt(2 + k, 40), now=0.0), 0.0)
        if isinstance(d, Decision):
            c.dispatched(d, request(f"o{k}", prompt(2 + k, 40)), 0.0)
    for iid in unhealthy:
        c.set_health(iid, False)
    fast = c.reject_hopeless(_head("r", slo_ttft_s=slo), now)
    full = c.schedule(request("r", prompt(1, blocks), now=now, slo_ttft_s=slo), now)
    if fast is not None:
        assert isinstance(full, Rejection), (fast, full)
        if full.reason is RejectReason.TTFT_SLO:
            assert full.predicted_ttft_s is not None and fast.predicted_ttft_s is not None
            assert full.predicted_ttft_s >= fast.predicted_ttft_s


def test_the_property_is_not_vacuous_over_the_test_fleets() -> None:
    """Over the routing test fleets' shapes, loaded past the SLO, the check does fire."""
    fired = 0
    for shape in ({"prefill": 3, "decode": 2}, {"prefill": 0, "decode": 0, "colocated": 4}):
        for policy in _POLICIES:
            c = make_conductor(admission=AdmissionMode.EARLY, policy=policy, **shape)
            for inst in c.instances.values():
                if inst.does_prefill:
                    busy(c, inst.id, 2.0)
            fast = c.reject_hopeless(_head("r", slo_ttft_s=0.5), 0.0)
            full = c.schedule(request("r", prompt(1, 100), slo_ttft_s=0.5), 0.0)
            assert fast is not None and isinstance(full, Rejection)
            fired += 1
    assert fired == 2 * len(_POLICIES)
