"""Semantic checks on the fleet's shape: pools, instances, models and the raw-table steps that
fill pool defaults in before typing (roles and models inherited by instances).

Like config/checks.py, each check is a mistake a user can make in a config file: duplicate
ids or URLs, a prefill pool without a decode pool, engines that cannot exchange KV, a
llama.cpp instance asked to do P/D, a model that names no pool or a pool no model serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from config.checker import Checker
from config.errors import MISSING
from config.settings import (
    EngineKind,
    InstanceSettings,
    KVConnector,
    PDProtocol,
    PoolSettings,
    ReplicationSink,
    Role,
    Settings,
)

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


def check_pools(c: Checker, pools: tuple[PoolSettings, ...]) -> None:
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


def _check_url(c: Checker, key: str, url: str) -> None:
    parts = urlsplit(url)
    c.require(
        parts.scheme in ("http", "https") and bool(parts.hostname),
        key,
        url,
        "must be an http:// or https:// URL with a host",
    )
    try:
        port_ok = parts.port is None or parts.port >= 1
    except ValueError:  # non-numeric or > 65535
        port_ok = False
    c.require(port_ok, key, url, "has an invalid port (must be 1..65535)")


def _check_instance(c: Checker, key: str, inst: InstanceSettings, pool: PoolSettings) -> None:
    c.non_empty(f"{key}.id", inst.id)
    _check_url(c, f"{key}.url", inst.url)
    if inst.sidecar_url is not None:
        _check_url(c, f"{key}.sidecar_url", inst.sidecar_url)
        c.require(
            inst.role is Role.DECODE,
            f"{key}.sidecar_url",
            inst.sidecar_url,
            f'is only used on decode instances (this one is "{inst.role}")',
        )
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


def check_models(c: Checker, s: Settings) -> None:
    pools = {p.name: p for p in s.pools}
    names: dict[Any, str] = {}
    served_by: dict[str, str] = {}
    for i, m in enumerate(s.models):
        key = f"models[{i}]"
        c.non_empty(f"{key}.name", m.name)
        for name in m.names():
            c.unique(f"{key}.name", name, names, "model name, alias or LoRA adapter")
        for j, adapter in enumerate(m.lora_adapters):
            c.non_empty(f"{key}.lora_adapters[{j}]", adapter)
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
        seen: dict[Any, str] = {}
        for j, adapter in enumerate(s.routing.lora_adapters):
            c.non_empty(f"routing.lora_adapters[{j}]", adapter)
            c.unique(f"routing.lora_adapters[{j}]", adapter, seen, "LoRA adapter")
        return
    c.require(
        not s.routing.lora_adapters,
        "routing.lora_adapters",
        list(s.routing.lora_adapters),
        "with a models table, list each model's adapters in models[].lora_adapters",
    )
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


def check_pool_sinks(c: Checker, pools: tuple[PoolSettings, ...], default: ReplicationSink) -> None:
    # Prefix copies go to instances that prefill; a decode pool never receives one.
    for i, pool in enumerate(pools):
        c.require(
            pool.replication_sink is None or pool.role is not Role.DECODE,
            f"pools[{i}].replication_sink",
            pool.replication_sink,
            "is not used by a decode pool (prefix copies go to instances that prefill)",
        )
        # A copy through a connector's store needs an engine with a KV connector.
        sink = pool.replication_sink or default
        if sink is ReplicationSink.CONNECTOR_STORE and pool.role is not Role.DECODE:
            c.require(
                all(inst.engine is not EngineKind.LLAMACPP for inst in pool.instances),
                f"pools[{i}].replication_sink" if pool.replication_sink else "replication.sink",
                sink.value,
                f"needs engines whose KV connector shares a store (vLLM); pool {pool.name!r} "
                "has llama.cpp instances, which have none: use 'warmup' there",
            )
