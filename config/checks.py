"""Semantic checks on well-typed settings: ranges and cross-field limits per section (the fleet's
shape, pools, instances and models, is config/fleet_checks.py).

Types are already right when these run (``config.coerce``); each check here is a mistake a
user can make in a config file that would otherwise surface later as odd routing behaviour.
"""

from __future__ import annotations

from typing import Any

from config.admission_settings import PeerOverloadSettings
from config.checker import Checker
from config.errors import IssueCollector
from config.fleet_checks import check_models, check_pool_sinks, check_pools
from config.replica_checks import check_replicas
from config.settings import (
    AdmissionSettings,
    PredictorSettings,
    ReplicationSettings,
    RoutingSettings,
    ServerSettings,
    Settings,
    SLOSettings,
)
from config.tenant_checks import check_tenants

MAX_BLOCK_SIZE = 4096


def check_settings(s: Settings, issues: IssueCollector) -> None:
    c = Checker(issues)
    _check_slo(c, s.slo)
    _check_routing(c, s.routing)
    _check_admission(c, s.admission)
    c.require(
        s.admission.mode != "peer" or s.routing.policy in PEER_POLICIES,
        "admission.mode",
        s.admission.mode.value,
        f"'peer' needs a peer routing.policy ({', '.join(PEER_POLICIES)})",
    )
    _check_predictors(c, s.predictors)
    check_pools(c, s.pools)
    check_models(c, s)
    _check_replication(c, s.replication)
    check_pool_sinks(c, s.pools, s.replication.sink)
    _check_server(c, s.server)
    check_tenants(c, s.tenants)
    check_replicas(c, s.replicas)


def _check_slo(c: Checker, slo: SLOSettings) -> None:
    for name in ("ttft_s", "tbt_s", "min_ttft_s", "min_tbt_s"):
        c.positive(f"slo.{name}", getattr(slo, name))
    c.ordered("slo.min_ttft_s", slo.min_ttft_s, "slo.max_ttft_s", slo.max_ttft_s)
    c.ordered("slo.min_tbt_s", slo.min_tbt_s, "slo.max_tbt_s", slo.max_tbt_s)
    names: dict[Any, str] = {}
    levels: dict[Any, str] = {}
    for i, p in enumerate(slo.priorities):
        key = f"slo.priorities[{i}]"
        c.non_empty(f"{key}.name", p.name)
        c.unique(f"{key}.name", p.name, names, "priority name")
        c.unique(f"{key}.level", p.level, levels, "priority level")
        c.fraction(f"{key}.headroom", p.headroom)
        if p.tbt_headroom is not None:
            c.fraction(f"{key}.tbt_headroom", p.tbt_headroom)
        c.positive(f"{key}.ttft_s", p.ttft_s)
        c.positive(f"{key}.tbt_s", p.tbt_s)
    known = ", ".join(f'"{p.name}"' for p in slo.priorities) or "none defined"
    c.require(
        slo.default_priority in names,
        "slo.default_priority",
        slo.default_priority,
        f"must name a priority class (known: {known})",
    )


def _check_routing(c: Checker, r: RoutingSettings) -> None:
    c.non_empty("routing.policy", r.policy)
    if r.policy.strip():
        _check_policy(c, r)
    c.between("routing.block_size", r.block_size, 1, MAX_BLOCK_SIZE)
    c.at_least("routing.kvcache_balancing_threshold", r.kvcache_balancing_threshold, 1)
    c.at_least("routing.min_transfer_blocks", r.min_transfer_blocks, 0)
    c.at_least("routing.llamacpp_slot_max_waiting", r.llamacpp_slot_max_waiting, 0)
    c.at_least("routing.llamacpp_evict_weight", r.llamacpp_evict_weight, 0.0)
    c.non_empty("routing.llamacpp_slot_save_path", r.llamacpp_slot_save_path)
    c.at_least("routing.llamacpp_slot_files_max", r.llamacpp_slot_files_max, 1)
    c.at_least("routing.lora_cpu_adapters", r.lora_cpu_adapters, 0)
    c.at_least("routing.lora_load_s", r.lora_load_s, 0)
    c.positive("routing.predict_on_route_ttl_s", r.predict_on_route_ttl_s)
    c.non_empty("routing.model_dir", r.model_dir)
    c.non_empty("routing.tokenizer_file", r.tokenizer_file)
    c.positive("routing.chars_per_token", r.chars_per_token)
    c.at_least("routing.tokenize_offload_chars", r.tokenize_offload_chars, 0)
    c.at_least("routing.seed", r.seed, 0)  # a seed is an id to reproduce a run: kept >= 0


def _check_policy(c: Checker, r: RoutingSettings) -> None:
    """The policy's name and parameters, checked here once for every entry point (the CLI,
    serve, reload, the admin API): building the policy is how they are validated."""
    # Imported here: the policies import config.settings, so a top-level import would cycle.
    from routing.policies.registry import PolicyError, build_policy

    try:
        build_policy(r.policy, r.params)
    except PolicyError as exc:
        c.require(False, exc.key, exc.value, exc.detail)
    except (TypeError, ValueError) as exc:  # the policy's own constructor refused a value
        c.require(False, "routing.params", dict(r.params), str(exc))


def _check_admission(c: Checker, a: AdmissionSettings) -> None:
    c.positive("admission.ttft_margin", a.ttft_margin)
    c.positive("admission.tbt_margin", a.tbt_margin)
    c.at_least("admission.retry_after_min_s", a.retry_after_min_s, 0)
    c.positive("admission.retry_after_max_s", a.retry_after_max_s)
    c.ordered(
        "admission.retry_after_min_s",
        a.retry_after_min_s,
        "admission.retry_after_max_s",
        a.retry_after_max_s,
    )
    _check_peer_overload(c, a.peer)
    b = a.best_effort
    c.between("admission.best_effort.idle_share", b.idle_share, 0.0, 1.0)
    c.between("admission.best_effort.max_decode_load", b.max_decode_load, 0.0, 1.0)
    c.at_least("admission.doomed_warmup.min_idle", a.doomed_warmup.min_idle, 1)
    c.between("admission.decode_queue.max_wait_share", a.decode_queue.max_wait_share, 0, 1)
    c.at_least("admission.decode_queue.max_wait_s", a.decode_queue.max_wait_s, 0)
    c.at_least("admission.decode_queue.max_parked", a.decode_queue.max_parked, 0)
    c.at_least("admission.decode_queue.tries", a.decode_queue.tries, 1)
    c.between("admission.doomed_warmup.max_decode_load", a.doomed_warmup.max_decode_load, 0, 1)
    r = a.decode_reservation
    key = "admission.decode_reservation."
    c.between(key + "fraction", r.fraction, 0.0, 0.9)
    c.between(key + "from_quantile", r.from_quantile, 0.0, 0.99)
    c.between(key + "min_pressure", r.min_pressure, 0.0, 1.0)
    c.between(key + "min_admit_ratio", r.min_admit_ratio, 0.0, 1.0)
    c.at_least(key + "window", r.window, 1)
    c.at_least(key + "pressure_window", r.pressure_window, 1)
    h = a.tbt_headroom
    key = "admission.tbt_headroom."
    c.between(key + "target_miss", h.target_miss, 0.0, 1.0)
    c.at_least(key + "window", h.window, 1)
    c.between(key + "raise_step", h.raise_step, 0.0, 1.0)
    c.between(key + "lower_step", h.lower_step, 0.0, 1.0)
    c.between(key + "min_share", h.min_share, 0.0, 1.0)
    w = a.wait_margin
    key = "admission.wait_margin."
    c.between(key + "target_miss", w.target_miss, 0.0, 1.0)
    c.at_least(key + "window", w.window, 1)
    c.positive(key + "raise_gain", w.raise_gain)
    c.between(key + "lower_step", w.lower_step, 0.0, 1.0)
    c.at_least(key + "max_factor", w.max_factor, 1.0)
    st = a.prefill_stall
    key = "admission.prefill_stall."
    c.between(key + "max_credit", st.max_credit, 0.0, 1.0)
    c.between(key + "credit", st.credit, 0.0, st.max_credit)
    c.between(key + "target_miss", st.target_miss, 0.0, 1.0)
    c.at_least(key + "window", st.window, 1)
    c.between(key + "raise_step", st.raise_step, 0.0, 1.0)
    c.between(key + "lower_factor", st.lower_factor, 0.0, 1.0)


# Policies with a shipped overload control (routing/policies/peer_overload.py).
PEER_POLICIES = ("sglang_cache_aware", "llmd_weighted", "dynamo_kv")


def _check_peer_overload(c: Checker, p: PeerOverloadSettings) -> None:
    key = "admission.peer."
    c.require(
        p.smg_max_concurrent_requests == -1 or p.smg_max_concurrent_requests >= 1,
        key + "smg_max_concurrent_requests",
        p.smg_max_concurrent_requests,
        "must be -1 (off) or at least 1",
    )
    c.at_least(key + "smg_queue_size", p.smg_queue_size, 0)
    c.at_least(key + "smg_queue_timeout_s", p.smg_queue_timeout_s, 0)
    c.positive(key + "smg_rate_limit_tokens_per_second", p.smg_rate_limit_tokens_per_second)
    c.positive(key + "gie_queue_depth_threshold", p.gie_queue_depth_threshold)
    c.positive(key + "gie_kv_cache_util_threshold", p.gie_kv_cache_util_threshold)
    c.positive(key + "gie_metrics_staleness_s", p.gie_metrics_staleness_s)
    c.at_least(key + "gie_scrape_interval_s", p.gie_scrape_interval_s, 0)
    c.require(
        p.gie_admitter in ("saturation", "probabilistic"),
        key + "gie_admitter",
        p.gie_admitter,
        "must be 'saturation' or 'probabilistic'",
    )
    c.positive(
        key + "dynamo_active_decode_blocks_threshold", p.dynamo_active_decode_blocks_threshold
    )
    c.positive(
        key + "dynamo_active_prefill_tokens_threshold_frac",
        p.dynamo_active_prefill_tokens_threshold_frac,
    )
    c.at_least(key + "dynamo_max_num_batched_tokens", p.dynamo_max_num_batched_tokens, 1)


def _check_predictors(c: Checker, p: PredictorSettings) -> None:
    c.non_empty("predictors.profile", p.profile)
    c.non_empty("predictors.prefill_model_file", p.prefill_model_file)
    c.non_empty("predictors.profile_file", p.profile_file)
    for i, path in enumerate(p.profile_files):
        c.non_empty(f"predictors.profile_files[{i}]", path)
    c.at_least("predictors.overhead_ms", p.overhead_ms, 0)
    for name in ("link_bandwidth_gbps", "host_load_gbps", "store_load_gbps"):
        c.positive(f"predictors.{name}", getattr(p, name))
    c.at_least("predictors.output_length_history", p.output_length_history, 1)
    c.fraction("predictors.output_length_quantile", p.output_length_quantile)
    c.at_least("predictors.default_output_tokens", p.default_output_tokens, 1)
    c.fraction("predictors.queue_scale_rate", p.queue_scale_rate)


def _check_replication(c: Checker, r: ReplicationSettings) -> None:
    for name in ("hot_rate_per_s", "rate_half_life_s", "timeout_s"):
        c.positive(f"replication.{name}", getattr(r, name))
    for name in ("min_prefix_blocks", "max_replicas", "max_in_flight"):
        c.at_least(f"replication.{name}", getattr(r, name), 1)
    c.at_least("replication.max_in_flight_per_destination", r.max_in_flight_per_destination, 1)
    c.ordered(
        "replication.max_in_flight_per_destination",
        r.max_in_flight_per_destination,
        "replication.max_in_flight",
        r.max_in_flight,
    )
    for name in ("holder_queue_threshold_s", "cooldown_s", "max_retries"):
        c.at_least(f"replication.{name}", getattr(r, name), 0)
    c.positive("replication.warmup_max_queue_s", r.warmup_max_queue_s)
    c.at_least("replication.warmup_prefix_bytes", r.warmup_prefix_bytes, 1)


def _check_server(c: Checker, s: ServerSettings) -> None:
    c.non_empty("server.host", s.host)
    c.at_least("server.refit_interval_s", s.refit_interval_s, 0)
    c.at_least("server.refit_min_samples", s.refit_min_samples, 1)
    c.at_least("server.refit_min_new_samples", s.refit_min_new_samples, 1)
    c.at_least("server.refit_window", s.refit_window, 1)
    c.at_least("server.max_batch_prompts", s.max_batch_prompts, 1)
    c.between("server.port", s.port, 1, 65535)
    c.positive("server.health_interval_s", s.health_interval_s)
    c.positive("server.health_timeout_s", s.health_timeout_s)
    c.at_least("server.startup_wait_s", s.startup_wait_s, 0.0)
    c.positive("server.health_recheck_s", s.health_recheck_s)
    c.positive("server.silence_predicted_factor", s.silence_predicted_factor)
    c.positive("server.silence_slo_factor", s.silence_slo_factor)
    c.positive("server.silence_min_s", s.silence_min_s)
    c.ordered("server.silence_min_s", s.silence_min_s, "server.silence_max_s", s.silence_max_s)
    c.at_least("server.drain_timeout_s", s.drain_timeout_s, 0)
    c.positive("server.keep_alive_s", s.keep_alive_s)
    if s.admin_token is not None:
        # A token read from a file often carries a trailing newline; it would never match.
        c.require(
            s.admin_token != "" and s.admin_token == "".join(s.admin_token.split()),
            "server.admin_token",
            s.admin_token,
            "must be non-empty and contain no whitespace",
        )
