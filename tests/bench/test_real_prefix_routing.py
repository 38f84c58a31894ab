"""bench.real_prefix_routing's bookkeeping, without engines: the workload's bound and the
per-request records the JSON keeps for tail analysis."""

from __future__ import annotations

from bench.real_prefix_routing import RequestRecord, RunResult, _brief


def test_the_bound_reuses_the_most_any_engine_cached_for_each_repeat() -> None:
    out = RunResult("kvcache_centric")
    out.per_request += [  # in finish order; the bound goes by the workload's order
        RequestRecord(1, 1, 800, 0, "e1", 0.1, 0.8),
        RequestRecord(0, 0, 1000, 0, "e0", 0.0, 0.9),  # first use of prompt 0: counts nothing
        RequestRecord(0, 2, 1000, 960, "e0", 0.2, 0.1),
        RequestRecord(0, 3, 1000, 500, "e2", 0.3, 0.4),  # a repeat: counted at the best, 960
    ]
    assert out.bound_cached_tokens() == 960 + 960


def test_the_slots_bound_keeps_only_the_repeats_a_fleet_of_that_many_slots_could() -> None:
    out = RunResult("kvcache_centric", cache_lines=1)
    picks = [0, 1, 0, 1, 0]  # one slot: every switch is a miss, whatever the placement
    out.per_request += [RequestRecord(p, i, 100, 90, "e0", i, 0.1) for i, p in enumerate(picks)]
    assert out.bound_cached_tokens() == 3 * 90  # an infinite cache: every repeat
    assert out.bound_cached_tokens(1) == 0
    assert out.bound_cached_tokens(2) == 3 * 90
    summary = out.summary()
    assert summary["slots_bound_hit_ratio"] == 0.0 and summary["bound_hit_ratio"] == 270 / 500
    assert RunResult("x").summary()["slots_bound_hit_ratio"] is None  # a shared block cache


def test_the_summary_keeps_every_record_and_the_brief_drops_them() -> None:
    out = RunResult("round_robin")
    out.per_request += [
        RequestRecord(3, 0, 100, 0, "e1", 0.0, 0.5),
        RequestRecord(3, 1, 100, 96, "e2", 0.4, 0.1),
    ]
    summary = out.summary()
    assert summary["requests"][1] == {
        "pick": 3,
        "index": 1,
        "prompt_tokens": 100,
        "cached_tokens": 96,
        "engine": "e2",
        "sent_s": 0.4,
        "ttft_s": 0.1,
    }
    assert "requests" not in _brief(summary) and _brief(summary)["completed"] == 2
    assert summary["ttft_mean_s"] == 0.3 and summary["engine_hit_ratio"] == 96 / 200


def test_llama_servers_are_declared_so_envoy_takes_one_request_per_connection(tmp_path) -> None:
    from types import SimpleNamespace

    from bench.real_prefix_routing import gateway_config
    from config.loader import load_settings
    from gateway.epp.envoy import fleet_endpoints

    for kind, want in (("llamacpp", 1), ("vllm", None)):
        engines = [
            SimpleNamespace(kind=kind, url=f"http://127.0.0.1:{4100 + i}", kv_events_endpoint=None)
            for i in range(2)
        ]
        path = tmp_path / f"{kind}.toml"
        path.write_text(gateway_config(engines, "round_robin", 18999, "", None))  # type: ignore[arg-type]
        endpoints, per_connection = fleet_endpoints(load_settings(path))
        assert endpoints == [("127.0.0.1", 4100), ("127.0.0.1", 4101)]
        assert per_connection == want
