"""Semantic checks on well-typed settings: ranges, cross-field limits, uniqueness, topology.

Types are already right when these run (``config.coerce``); each check here is a mistake a
user can make in a config file that would otherwise surface later as odd routing behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from config.checker import Checker
from config.errors import MISSING, IssueCollector
from config.replica_checks import check_replicas
from config.settings import (
    AdmissionSettings,
    EngineKind,
    InstanceSettings,
    KVConnector,
    PDProtocol,
    PeerOverloadSettings,
    PoolSettings,
    PredictorSettings,
    ReplicationSettings,
    Role,
    RoutingSettings,
    ServerSettings,
    Settings,
    SLOSettings,
)
from config.tenant_checks import check_tenants

MAX_BLOCK_SIZE = 4096
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def inherit_pool_role(pool: Mapping[str, Any]) -> Mapping[str, Any]:
    """An instance table inside a pool may omit ``role`` and ``model``: it inherits the pool's."""
    role, instances = pool.get("role"), pool.get("instances")
    if not isinstance(instances, list):
        return pool
    inherited = {}
    # An invalid pool role is reported once, on the pool, not on every instance.
    if isinstance(role, str) and role.lower() in {r.value for r in Role}:
        inherited["role"] = role
    for key in ("model", "kv_connector"):
        if isinstance(pool.get(key), str):
            inherited[key] = pool[key]
    filled = [{**inherited, **inst} if isinstance(inst, Mapping) else inst for inst in instances]
    return {**pool, "instances": filled}


def assign_pool_models(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``models[].pools`` names the pools of each model: write the model's name into those pools
    (which pass it on to their instances). Mismatches are reported by the checks."""
    models, pools = data.get("models"), data.get("pools")
    if not isinstance(models, list) or not isinstance(pools, list):
        return data
    owner: dict[str, str] = {}
    for m in models:
        if isinstance(m, Mapping) and isinstance(m.get("name"), str):
            for pool_name in m.get("pools") or ():
                if isinstance(pool_name, str):
                    owner.setdefault(pool_name, m["name"])
    filled = [
        {"model": owner[p["name"]], **p}
        if isinstance(p, Mapping) and isinstance(p.get("name"), str) and p["name"] in owner
        else p
        for p in pools
    ]
    return {**data, "pools": filled}


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
    _check_pools(c, s.pools)
    _check_models(c, s)
    _check_replication(c, s.replication)
    _check_pool_sinks(c, s.pools)
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
    c.positive("routing.predict_on_route_ttl_s", r.predict_on_route_ttl_s)
    c.non_empty("routing.model_dir", r.model_dir)
    c.non_empty("routing.tokenizer_file", r.tokenizer_file)
    c.positive("routing.chars_per_token", r.chars_per_token)
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


def _check_pools(c: Checker, pools: tuple[PoolSettings, ...]) -> None:
    pool_names: dict[Any, str] = {}
    ids: dict[Any, str] = {}
    urls: dict[Any, str] = {}
    disaggregated: list[tuple[str, InstanceSettings]] = []
    for i, pool in enumerate(pools):
        key = f"pools[{i}]"
        c.non_empty(f"{key}.name", pool.name)
        c.unique(f"{key}.name", pool.name, pool_names, "pool name")
        for j, inst in enumerate(pool.instances):
            ikey = f"{key}.instances[{j}]"
            _check_instance(c, ikey, inst, pool)
            c.unique(f"{ikey}.id", inst.id, ids, "instance id")
            c.unique(f"{ikey}.url", inst.url, urls, "instance url", inst.url.rstrip("/").lower())
            if inst.role is not Role.BOTH:
                disaggregated.append((ikey, inst))
    roles = {inst.role for _, inst in disaggregated}
    if len(roles) == 1:
        have = roles.pop()
        need = Role.DECODE if have is Role.PREFILL else Role.PREFILL
        c.require(False, "pools", MISSING, f"has {have} instances but no {need} instance")
    protocols = {inst.protocol for _, inst in disaggregated}
    if len(protocols) > 1:
        # KV moves from prefill to decode engines; vLLM and SGLang cannot exchange it.
        ikey, inst = disaggregated[-1]
        first = disaggregated[0][1].protocol
        msg = f"prefill/decode instances must share one protocol (others use {first})"
        c.require(False, f"{ikey}.protocol", inst.protocol, msg)
    _check_kv_connectors(c, disaggregated)


def _check_kv_connectors(c: Checker, disaggregated: list[tuple[str, InstanceSettings]]) -> None:
    """A model's prefill and decode engines move KV one way: one vLLM connector style each."""
    first: dict[str | None, KVConnector] = {}
    for ikey, inst in disaggregated:
        style = inst.kv_connector or KVConnector.NIXL
        other = first.setdefault(inst.model, style)
        if style is not other:
            msg = f"prefill/decode instances must share one kv_connector (others use {other})"
            c.require(False, f"{ikey}.kv_connector", inst.kv_connector, msg)
            return


def _check_instance(c: Checker, key: str, inst: InstanceSettings, pool: PoolSettings) -> None:
    c.non_empty(f"{key}.id", inst.id)
    parts = urlsplit(inst.url)
    c.require(
        parts.scheme in ("http", "https") and bool(parts.hostname),
        f"{key}.url",
        inst.url,
        "must be an http:// or https:// URL with a host",
    )
    try:
        port_ok = parts.port is None or parts.port >= 1
    except ValueError:  # non-numeric or > 65535
        port_ok = False
    c.require(port_ok, f"{key}.url", inst.url, "has an invalid port (must be 1..65535)")
    c.require(
        inst.role is pool.role,
        f"{key}.role",
        inst.role,
        f'must match its pool\'s role "{pool.role}" (or be omitted to inherit it)',
    )
    c.non_empty(f"{key}.profile", inst.profile)
    c.at_least(f"{key}.capacity_tokens", inst.capacity_tokens, 1)
    c.at_least(f"{key}.host_capacity_tokens", inst.host_capacity_tokens, 0)
    c.at_least(f"{key}.max_batch", inst.max_batch, 1)
    c.between(f"{key}.bootstrap_port", inst.bootstrap_port, 1, 65535)
    if inst.bootstrap_port is not None:
        c.require(
            inst.protocol is PDProtocol.SGLANG,
            f"{key}.bootstrap_port",
            inst.bootstrap_port,
            f'is only used with protocol = "sglang" (this instance is "{inst.protocol}")',
        )
    if inst.kv_connector is not None:
        c.require(
            inst.protocol is PDProtocol.VLLM,
            f"{key}.kv_connector",
            inst.kv_connector,
            f'is only used with protocol = "vllm" (this instance is "{inst.protocol}")',
        )
    if inst.kv_events_endpoint is not None:
        c.require(
            inst.kv_events_endpoint.startswith(_ZMQ_SCHEMES),
            f"{key}.kv_events_endpoint",
            inst.kv_events_endpoint,
            "must be a ZMQ endpoint such as tcp://127.0.0.1:5557",
        )
        if inst.kv_events_endpoint.startswith("tcp://"):
            host, _, port = inst.kv_events_endpoint[6:].rpartition(":")
            c.require(
                bool(host) and port.isdigit(),
                f"{key}.kv_events_endpoint",
                inst.kv_events_endpoint,
                "must be tcp://HOST:PORT (tcp://*:PORT when the engine binds)",
            )
    c.require(
        inst.kv_events_bind is None or inst.kv_events_endpoint is not None,
        f"{key}.kv_events_bind",
        inst.kv_events_bind,
        "is only used with kv_events_endpoint",
    )
    replay = inst.kv_events_replay_endpoint
    c.require(
        replay is None or inst.kv_events_endpoint is not None,
        f"{key}.kv_events_replay_endpoint",
        replay,
        "is only used with kv_events_endpoint",
    )
    c.require(
        replay is None or replay.startswith(_ZMQ_SCHEMES),
        f"{key}.kv_events_replay_endpoint",
        replay,
        "must be a ZMQ endpoint such as tcp://127.0.0.1:5558 (the engine binds it)",
    )
    c.require(
        inst.engine is not EngineKind.LLAMACPP or inst.role is Role.BOTH,
        f"{key}.engine",
        inst.engine,
        f'llama.cpp has no prefill/decode split: its role must be "both" (not "{inst.role}")',
    )


def _check_models(c: Checker, s: Settings) -> None:
    pools = {p.name: p for p in s.pools}
    names: dict[Any, str] = {}
    served_by: dict[str, str] = {}
    for i, m in enumerate(s.models):
        key = f"models[{i}]"
        c.non_empty(f"{key}.name", m.name)
        for name in m.names():
            c.unique(f"{key}.name", name, names, "model name or alias")
        c.require(bool(m.pools), f"{key}.pools", list(m.pools), "must name at least one pool")
        for pool_name in m.pools:
            if pool_name not in pools:
                known = ", ".join(sorted(pools)) or "none"
                c.require(False, f"{key}.pools", pool_name, f"is not a pool (pools: {known})")
            elif pool_name in served_by and served_by[pool_name] != m.name:
                other = served_by[pool_name]
                c.require(False, f"{key}.pools", pool_name, f"already serves model {other!r}")
            served_by.setdefault(pool_name, m.name)
        c.non_empty(f"{key}.profile", m.profile)
        c.positive(f"{key}.ttft_s", m.ttft_s)
        c.positive(f"{key}.tbt_s", m.tbt_s)
        roles = {p.role for n in m.pools if (p := pools.get(n)) is not None}
        if roles & {Role.PREFILL, Role.DECODE} and not {Role.PREFILL, Role.DECODE} <= roles:
            msg = "needs both a prefill and a decode pool"
            c.require(False, f"{key}.pools", list(m.pools), msg)
    if not s.models:
        return
    for i, pool in enumerate(s.pools):
        key = f"pools[{i}].model"
        if pool.name not in served_by:
            msg = "every pool must serve a model (list it in models[].pools)"
            c.require(False, key, pool.model, msg)
            continue
        owner = served_by[pool.name]
        c.require(pool.model == owner, key, pool.model, f"must be {owner!r}")
        for j, inst in enumerate(pool.instances):
            c.require(
                inst.model == pool.model,
                f"pools[{i}].instances[{j}].model",
                inst.model,
                f"must match its pool's model {pool.model!r} (or be omitted to inherit it)",
            )


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


def _check_pool_sinks(c: Checker, pools: tuple[PoolSettings, ...]) -> None:
    # Prefix copies go to instances that prefill; a decode pool never receives one.
    for i, pool in enumerate(pools):
        c.require(
            pool.replication_sink is None or pool.role is not Role.DECODE,
            f"pools[{i}].replication_sink",
            pool.replication_sink,
            "is not used by a decode pool (prefix copies go to instances that prefill)",
        )


def _check_server(c: Checker, s: ServerSettings) -> None:
    c.non_empty("server.host", s.host)
    c.at_least("server.refit_interval_s", s.refit_interval_s, 0)
    c.at_least("server.refit_min_samples", s.refit_min_samples, 1)
    c.at_least("server.refit_min_new_samples", s.refit_min_new_samples, 1)
    c.between("server.port", s.port, 1, 65535)
    c.positive("server.health_interval_s", s.health_interval_s)
    c.positive("server.health_timeout_s", s.health_timeout_s)
    c.positive("server.silence_predicted_factor", s.silence_predicted_factor)
    c.positive("server.silence_slo_factor", s.silence_slo_factor)
    c.positive("server.silence_min_s", s.silence_min_s)
    c.ordered("server.silence_min_s", s.silence_min_s, "server.silence_max_s", s.silence_max_s)
    c.at_least("server.drain_timeout_s", s.drain_timeout_s, 0)
    if s.admin_token is not None:
        # A token read from a file often carries a trailing newline; it would never match.
        c.require(
            s.admin_token != "" and s.admin_token == "".join(s.admin_token.split()),
            "server.admin_token",
            s.admin_token,
            "must be non-empty and contain no whitespace",
        )
