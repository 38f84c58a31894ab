"""The decode queue (routing/decode_queue.py) and the Conductor's side of it
(routing/parked_requests.py): which rejections wait, the cheapest admitted first when a decode
finishes, deadlines, and retries that count nowhere. Real Conductor, real predictors."""

from __future__ import annotations

from dataclasses import replace

from config.admission_settings import DecodeQueueSettings
from config.settings import AdmissionMode, SLOSettings
from routing.decode_queue import DecodeQueue
from routing.types import Decision, Rejection, RejectReason, RequestInfo
from tests.routing.fleet import full_decode_conductor, make_conductor, prompt, request


def _req(rid: str, tokens: int) -> RequestInfo:
    return RequestInfo(rid, tokens, (), max_tokens=16, arrival_s=0.0)


def test_the_shortest_prompts_come_first_and_deadlines_end_the_wait() -> None:
    q = DecodeQueue(DecodeQueueSettings(max_wait_share=0.5, max_wait_s=10.0, tries=2))
    assert q.park(_req("long", 9000), 0.0, 30.0)
    assert q.park(_req("short", 100), 1.0, 30.0)
    assert q.park(_req("mid", 2000), 2.0, 4.0)  # a 4 s TTFT SLO: waits 2 s
    assert [p.request.request_id for p in q.cheapest()] == ["short", "mid"]
    assert q.expire(3.9) == []
    assert [r.request_id for r in q.expire(4.0)] == ["mid"]
    assert q.entry("long") is not None and q.entry("long").deadline_s == 10.0  # max_wait_s
    assert q.admit("short") is not None and q.admit("short") is None
    assert [r.request_id for r in q.expire(11.0)] == ["long"]
    assert (len(q), q.parked, q.admitted, q.expired) == (0, 3, 1, 2)


def test_a_full_or_disabled_queue_takes_nothing() -> None:
    full = DecodeQueue(DecodeQueueSettings(max_parked=1))
    assert full.park(_req("a", 10), 0.0, 30.0) and not full.park(_req("b", 10), 0.0, 30.0)
    assert not DecodeQueue(DecodeQueueSettings(enabled=False)).park(_req("a", 10), 0.0, 30.0)
    assert not DecodeQueue(DecodeQueueSettings(max_wait_s=0.0)).park(_req("a", 10), 0.0, 30.0)


def test_a_request_turned_away_on_tbt_waits_and_a_finished_decode_admits_it() -> None:
    c = full_decode_conductor()
    req = request("r", prompt(1, 8))
    out = c.schedule(req, 0.0)
    assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
    rejections = dict(c.stats.rejections)
    assert c.park(out, req, 0.0)
    assert c.release_parked(1.0) is None  # still no room: its retry counts nowhere
    assert c.stats.rejections == rejections
    d0 = c.instances["d0"]
    for i in range(100):
        d0.remove_decode(f"run{i}", 1.5)
    released = c.release_parked(2.0)
    assert released is not None
    got, decision = released
    assert got.request_id == "r" and isinstance(decision, Decision)
    assert decision.slo_ttft_s < 30.0  # judged on the TTFT budget it has left
    assert c.release_parked(2.0) is None and len(c.decode_queue) == 0


def test_only_tbt_rejections_in_an_slo_mode_wait() -> None:
    c = full_decode_conductor()
    req = request("r", prompt(1, 8))
    rej = c.schedule(req, 0.0)
    assert isinstance(rej, Rejection)
    assert not c.park(replace(rej, reason=RejectReason.TTFT_SLO), req, 0.0)
    c.apply_settings(
        replace(c.settings, admission=replace(c.settings.admission, mode=AdmissionMode.NONE))
    )
    assert not c.park(rej, req, 0.0)


def test_a_decode_that_misses_the_check_even_alone_does_not_wait() -> None:
    # A 1 ms TBT SLO: even alone in a batch no decode step is that fast; no finished decode
    # can help, so it hears its 429 at once.
    c = make_conductor(
        prefill=1, decode=1, admission=AdmissionMode.EARLY, slo=SLOSettings(tbt_s=0.001)
    )
    req = request("r", prompt(2, 8))
    out = c.schedule(req, 0.0)
    assert isinstance(out, Rejection) and out.reason is RejectReason.TBT_SLO
    assert not c.park(out, req, 0.0) and len(c.decode_queue) == 0
