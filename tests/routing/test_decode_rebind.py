"""Late decode binding: when a prefill finishes, a decode whose instance can no longer take it
within the TBT SLO moves to one that can (routing/decode_placement.py ``rebind_target``,
``Conductor.rebind_decode``). Real Conductor, real predictors."""

from __future__ import annotations

from dataclasses import replace

from config.settings import (
    AdmissionMode,
    PDProtocol,
    PredictorSettings,
    PriorityClass,
    SLOSettings,
)
from routing.conductor import Conductor
from routing.decode_placement import rebind_target
from routing.instance_books import DecodeWork
from routing.types import Decision
from tests.routing.fleet import fleet_settings, prompt, request

# LLaMA2-70B on A100s (2023): ten 16k-token sequences fill a decode step's 100 ms.
PROFILE = PredictorSettings(profile="llama2-70b-a100-tp8-2023")
CTX = 16384


def _conductor(**kw: object) -> Conductor:
    return Conductor(fleet_settings(predictors=PROFILE, **kw))  # type: ignore[arg-type]


def _fill(c: Conductor, iid: str, seqs: int, context: int) -> None:
    """Running decodes on ``iid`` (as if dispatched earlier and already decoding)."""
    inst = c.instances[iid]
    for i in range(seqs):
        rid = f"run-{iid}-{i}"
        inst.add_incoming(DecodeWork(rid, context, 500, 0.0))
        inst.start_decode(rid, 0.0)


def _seqs_over(c: Conductor, iid: str, prompt_tokens: int, limit: float, context: int) -> int:
    """How many running sequences of ``context`` tokens push a newcomer past ``limit``."""
    inst = c.instances[iid]
    n = 1
    while inst.predictors.decode.step_time(n + 1, n * context + prompt_tokens) <= limit:
        n += 1
    return n


def _dispatch(c: Conductor, rid: str, now: float = 0.0) -> Decision:
    d = c.schedule(request(rid, prompt(7, 64)), now)
    assert isinstance(d, Decision)
    c.dispatched(d, request(rid, prompt(7, 64)), now)
    return d


def test_target_is_none_while_the_planned_instance_still_takes_it() -> None:
    c = _conductor(prefill=1, decode=2)
    d0, d1 = c.instances["d0"], c.instances["d1"]
    assert rebind_target(d0, [d0, d1], 1024, 2048, 0.1) is None


def test_target_is_the_fastest_instance_that_takes_it_within_the_slo() -> None:
    c = _conductor(prefill=1, decode=3)
    over = _seqs_over(c, "d0", 1024, 0.1, CTX)
    _fill(c, "d0", over, CTX)
    _fill(c, "d1", over // 2, CTX)  # takes it, but slower than d2
    pool = [c.instances[i] for i in ("d0", "d1", "d2")]
    assert c.instances["d0"].tbt_now(1, 1024) > 0.1
    assert rebind_target(pool[0], pool, 1024, 2048, 0.1) is pool[2]
    c.instances["d2"].healthy = False  # not eligible: the next best
    assert rebind_target(pool[0], pool, 1024, 2048, 0.1) is pool[1]


def test_no_target_when_no_other_instance_takes_it() -> None:
    c = _conductor(prefill=1, decode=2)
    over = _seqs_over(c, "d0", 1024, 0.1, CTX)
    _fill(c, "d0", over, CTX)
    _fill(c, "d1", over, CTX)
    pool = [c.instances["d0"], c.instances["d1"]]
    assert rebind_target(pool[0], pool, 1024, 2048, 0.1) is None
    c2 = _conductor(prefill=1, decode=2)
    _fill(c2, "d0", _seqs_over(c2, "d0", 1024, 0.1, CTX), CTX)
    d1 = c2.instances["d1"]
    d1.reserved_tokens = d1.capacity_tokens  # its KV is full
    pool2 = [c2.instances["d0"], d1]
    assert rebind_target(pool2[0], pool2, 1024, 2048, 0.1) is None


def test_conductor_moves_the_books_with_the_decode() -> None:
    c = _conductor(prefill=1, decode=2)
    d = _dispatch(c, "r1")
    planned, other = d.decode, "d1" if d.decode == "d0" else "d0"
    assert c.rebind_decode("r1", 1.0) is None  # still fits: stays
    _fill(c, planned, _seqs_over(c, planned, 1024, 0.1, CTX), CTX)
    assert c.rebind_decode("r1", 1.0) == other
    assert "r1" not in c.instances[planned].incoming
    assert "r1" in c.instances[other].incoming
    assert c.requests["r1"].decision.decode == other and c.stats.rebinds == 1
    c.prefill_done("r1", 1.5)  # the decode starts where it moved
    assert "r1" in c.instances[other].running
    c.finished("r1", 3.0, output_tokens=10)
    assert "r1" not in c.instances[other].running and c.instances[other].batch == 0
    assert c.rebind_decode("r1", 3.0) is None  # gone


def test_no_rebind_after_the_prefill_is_done_or_for_peer_policies() -> None:
    c = _conductor(prefill=1, decode=2)
    d = _dispatch(c, "r1")
    c.prefill_done("r1", 1.0)
    _fill(c, d.decode, _seqs_over(c, d.decode, 1024, 0.1, CTX), CTX)
    assert c.rebind_decode("r1", 1.0) is None
    peer = _conductor(prefill=1, decode=2, policy="sglang_cache_aware")
    pd = _dispatch(peer, "r2")
    _fill(peer, pd.decode, _seqs_over(peer, pd.decode, 1024, 0.1, CTX), CTX)
    assert peer.rebind_decode("r2", 1.0) is None and peer.stats.rebinds == 0


def test_no_rebind_behind_an_sglang_prefill_whose_decode_leg_has_left() -> None:
    settings = fleet_settings(predictors=PROFILE, prefill=1, decode=2)
    pools = tuple(
        replace(p, instances=tuple(replace(i, protocol=PDProtocol.SGLANG) for i in p.instances))
        for p in settings.pools
    )
    c = Conductor(replace(settings, pools=pools))
    d = _dispatch(c, "r1")
    _fill(c, d.decode, _seqs_over(c, d.decode, 1024, 0.1, CTX), CTX)
    assert c.rebind_decode("r1", 1.0) is None and c.stats.rebinds == 0


def test_colocated_decodes_never_move() -> None:
    c = _conductor(prefill=0, decode=0, colocated=2)
    d = _dispatch(c, "r1")
    assert d.prefill == d.decode
    _fill(c, d.decode, _seqs_over(c, d.decode, 1024, 0.1, CTX), CTX)
    assert c.rebind_decode("r1", 1.0) is None


def test_the_simulator_moves_decodes_only_with_the_switch_on() -> None:
    """Bursts of long prompts onto two decode instances, admitted up to the TBT SLO: with
    ``routing.decode_rebind`` some decodes move when their prefill is done, and fewer are
    refused by their engine; off, none move."""
    from replay.sim.fleet import FleetSpec
    from replay.sim.simulator import Simulator
    from replay.workload.traces import TraceRequest

    trace = [
        TraceRequest(i, (i // 6) * 1.5, 8192 + 512 * (i % 6), 300 + 40 * (i % 5), ())
        for i in range(240)
    ]
    fleet = FleetSpec(prefill=4, decode=2, profile="llama2-70b-a100-tp8-2023")
    no_tbt_headroom = tuple(
        PriorityClass(p.name, p.level, p.headroom, tbt_headroom=0.0)
        for p in SLOSettings().priorities
    )
    base = fleet_settings(
        prefill=0,
        decode=0,
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1, priorities=no_tbt_headroom),
        admission=AdmissionMode.EARLY,
    )
    runs = {}
    for on in (True, False):
        s = replace(base, routing=replace(base.routing, decode_rebind=on))
        res = Simulator(s, fleet, trace).run()
        refused = sum(r.outcome.name == "REJECTED_AFTER_PREFILL" for r in res.requests)
        runs[on] = (res.extra["decode_rebinds"], refused)
    assert runs[False][0] == 0
    assert runs[True][0] > 0
    assert runs[True][1] < runs[False][1]
