"""Admission mode ``peer``: each peer's shipped overload control, through the real Conductor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from config.admission_settings import PeerOverloadSettings
from config.checks import check_settings
from config.errors import IssueCollector
from config.settings import AdmissionMode, AdmissionSettings
from replay.sim.run_specs import parse_run_specs
from routing.conductor import Conductor
from routing.instance_books import DecodeWork
from routing.types import Decision, Rejection, RejectReason
from tests.routing.fleet import fleet_settings, prompt, request


def with_peer(policy: str, prefill: int = 3, decode: int = 2, **peer: object) -> Conductor:
    s = fleet_settings(prefill, decode, policy=policy)
    adm = AdmissionSettings(mode=AdmissionMode.PEER, peer=PeerOverloadSettings(**peer))
    return Conductor(replace(s, admission=adm))


def submit(c: Conductor, rid: str, now: float = 0.0) -> Decision | Rejection:
    req = request(rid, prompt(hash(rid) % 1000, 4), now=now)
    d = c.schedule(req, now)
    if isinstance(d, Decision):
        c.dispatched(d, req, now)
    return d


# ------------------------------------------------------------------ SMG
def test_smg_limiter_is_off_by_default() -> None:
    c = with_peer("sglang_cache_aware")
    assert all(isinstance(submit(c, f"r{i}"), Decision) for i in range(300))


def test_smg_concurrency_slots_then_fifo_then_429() -> None:
    c = with_peer("sglang_cache_aware", smg_max_concurrent_requests=2, smg_queue_size=1)
    assert isinstance(submit(c, "a"), Decision)  # slot 1, budget 2 -> 1
    assert isinstance(submit(c, "b"), Decision)  # slot 2, budget 0
    assert isinstance(submit(c, "c"), Decision)  # no slot: waits (queue 0 < 1)
    rej = submit(c, "d")  # 1 waiting beyond the slots + 1 on budget debt >= queue size 1
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.PEER_OVERLOAD
    assert rej.http_status == 429 and "queue full" in rej.message


def test_smg_token_bucket_refills_at_the_rate() -> None:
    c = with_peer(
        "sglang_cache_aware",
        smg_max_concurrent_requests=100,
        smg_rate_limit_tokens_per_second=1.0,
        smg_queue_size=0,
    )
    for i in range(100):  # the burst: capacity 100
        assert isinstance(submit(c, f"r{i}"), Decision)
    assert isinstance(submit(c, "late", now=0.0), Rejection)  # budget spent, no queue
    # free the slots: the budget, not concurrency, is what limits now
    for inst in c.instances.values():
        for rid in list(inst.incoming):
            inst.remove_decode(rid, 0.0)
    assert isinstance(submit(c, "x", now=0.5), Rejection)  # 0.5 token refilled
    assert isinstance(submit(c, "y", now=1.0), Decision)  # 1 token refilled


# ------------------------------------------------------------------ GIE / llm-d
def fill_prefill_queues(c: Conductor, per_instance: int) -> None:
    for inst in c.instances.values():
        if inst.role.value == "prefill":
            for i in range(per_instance):
                inst.enqueue_prefill(f"{inst.id}-{i}", 1.0, 16, 0.0, 0.0)


def test_gie_sheds_sheddable_requests_when_the_pool_is_saturated() -> None:
    # 3 prefill pods with 10 waiting (q/5 = 2) and 2 idle decode pods: mean 6/5 = 1.2 >= 1
    c = with_peer("llmd_weighted")
    fill_prefill_queues(c, 11)
    rej = submit(c, "r")
    assert isinstance(rej, Rejection) and rej.reason is RejectReason.PEER_OVERLOAD
    # 5 waiting each: mean 3/5 = 0.6 < 1, admitted
    c = with_peer("llmd_weighted")
    fill_prefill_queues(c, 6)
    assert isinstance(submit(c, "r"), Decision)


def test_gie_never_sheds_non_sheddable_requests() -> None:
    c = with_peer("llmd_weighted", gie_sheddable=False)
    fill_prefill_queues(c, 50)
    assert isinstance(submit(c, "r"), Decision)


def test_gie_stale_metrics_mean_saturated() -> None:
    c = with_peer("llmd_weighted", gie_scrape_interval_s=1.0, gie_metrics_staleness_s=0.2)
    assert isinstance(submit(c, "r"), Rejection)


# ------------------------------------------------------------------ Dynamo
def test_dynamo_rejects_only_when_every_prefill_worker_is_busy() -> None:
    # busy: active prefill tokens > 1.0 x 64
    c = with_peer(
        "dynamo_kv",
        dynamo_active_prefill_tokens_threshold_frac=1.0,
        dynamo_max_num_batched_tokens=64,
    )
    for inst in ("p0", "p1"):
        c.instances[inst].enqueue_prefill(f"f-{inst}", 1.0, 65, 0.0, 0.0)
    assert isinstance(submit(c, "a"), Decision)  # p2 is not busy
    c.instances["p2"].enqueue_prefill("f-p2", 1.0, 65, 0.0, 0.0)
    rej = submit(c, "b")
    assert isinstance(rej, Rejection) and "prefill workers busy" in rej.message


def test_dynamo_decode_busy_threshold() -> None:
    c = with_peer("dynamo_kv", dynamo_active_decode_blocks_threshold=0.5)
    for d in ("d0", "d1"):
        inst = c.instances[d]
        inst.add_incoming(DecodeWork(f"w-{d}", inst.capacity_tokens // 2 + 64, 1, 0.0))
    rej = submit(c, "a")
    assert isinstance(rej, Rejection) and "decode workers busy" in rej.message


# ------------------------------------------------------------------ wiring
def test_peer_admission_needs_a_peer_policy() -> None:
    specs = parse_run_specs("sglang_cache_aware+peer,llmd_weighted+peer,dynamo_kv+peer", None)
    assert [s.admission for s in specs] == [AdmissionMode.PEER] * 3
    with pytest.raises(ValueError, match="needs a peer policy"):
        parse_run_specs("least_load+peer", None)
    issues = IssueCollector("test")
    s = fleet_settings(policy="least_load", admission=AdmissionMode.PEER)
    check_settings(s, issues)
    assert any(i.key == "admission.mode" for i in issues.issues)


def test_sim_tune_names_the_winning_setting(tmp_path: Path) -> None:
    from gateway.cli import main
    from replay.workload.synthetic import chat_spec, generate, write_mooncake

    trace = tmp_path / "t.jsonl"
    write_mooncake(generate(chat_spec(requests=40, rate_rps=20.0, seed=1)), trace)
    out = tmp_path / "r.json"
    args = ["sim", str(trace), "--prefill", "2", "--decode", "2", "--quiet", "--tune"]
    args += ["--profile", "llama3-8b-h100-tp1", "--compare", "dynamo_kv+peer", "--json", str(out)]
    assert main(args) == 0
    import json

    run = json.loads(out.read_text())["runs"][0]
    assert run["label"].startswith("dynamo_kv+peer[active_prefill_tokens_threshold_frac=")
    assert run["peer_setting"].startswith("dynamo_active_prefill_tokens_threshold_frac=")
