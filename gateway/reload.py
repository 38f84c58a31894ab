"""Configuration reload without a restart: SIGHUP (gateway/serve.py) and POST /admin/reload.

The config file ``kvgate serve`` started from is read again and validated exactly like at
start-up (the same loader: file, ``KVGATE__*`` environment, every check, the policy built
once). A file that does not validate changes nothing: the running configuration stays, the
admin call answers 400 with the loader's message (file, key, TOML line) and the log says the
same. A valid file is applied live: instances added, removed or changed (a changed instance is
removed and added again), SLOs, policy, admission, replication settings and the server's
timeouts. What the running process built once at start-up cannot change in place; those keys
keep their running values and the answer lists them under ``restart_required``.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from config.loader import ConfigError, load_settings, settings_from_dict, settings_to_dict
from config.settings import Settings
from config.tenant_keys import tenant_keys
from routing.policies.registry import PolicyError, build_policy

if TYPE_CHECKING:
    from gateway.runtime import Gateway

log = logging.getLogger("kvgate.reload")

# Built once at start-up (listening socket, tokenizer and key space, predictors, sinks,
# tracing exporter, model routes, llama.cpp slot book): a reload keeps the running values.
RESTART_KEYS: tuple[tuple[str, str | None], ...] = (
    ("server", "host"),
    ("server", "port"),
    ("server", "tracing"),
    ("server", "otlp_endpoint"),
    ("server", "keep_alive_s"),
    ("server", "recent_decisions"),
    ("routing", "block_size"),
    ("routing", "model_dir"),
    ("routing", "tiktoken"),
    ("routing", "template_skeletons"),
    ("routing", "tokenizer_file"),
    ("routing", "lora_adapters"),
    ("routing", "chars_per_token"),
    ("routing", "llamacpp_slot_max_waiting"),
    ("routing", "llamacpp_slot_save_path"),
    ("routing", "llamacpp_slot_files_max"),
    ("replication", "sink"),
    ("predictors", None),
    ("models", None),
    ("replicas", None),
)


@dataclass(slots=True)
class ReloadResult:
    """What a reload did (``ok``) or why it changed nothing (``error``)."""

    ok: bool
    source: str
    error: str | None = None
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _keep_running_values(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    """Put the running values of the restart-only keys into ``new``; returns those that the
    file changed."""
    kept = []
    for section, key in RESTART_KEYS:
        if key is None:
            if new.get(section) != old.get(section):
                kept.append(section)
            if section in old:
                new[section] = old[section]
            else:
                new.pop(section, None)
            continue
        new_sec = dict(new.get(section, {}))
        old_sec = old.get(section, {})
        if new_sec.get(key) != old_sec.get(key):
            kept.append(f"{section}.{key}")
        if key in old_sec:
            new_sec[key] = old_sec[key]
        else:
            new_sec.pop(key, None)
        new[section] = new_sec
    return kept


def prepare(gw: Gateway, loaded: Settings, source: str) -> tuple[Settings, list[str]]:
    """The settings a reload applies: ``loaded`` with the restart-only keys at their running
    values, validated again as a whole (raises ``ConfigError``/``PolicyError``)."""
    build_policy(loaded.routing.policy, loaded.routing.params)  # as build_app does at start
    merged = settings_to_dict(loaded)
    kept = _keep_running_values(merged, settings_to_dict(gw.settings))
    return settings_from_dict(merged, source=source), kept


def apply(gw: Gateway, new: Settings, result: ReloadResult) -> None:
    """Apply validated settings to the running gateway (instances first, then the rest)."""
    old = {i.id: i for i in gw.settings.instances()}
    fresh = {i.id: i for i in new.instances()}
    for iid, spec in old.items():
        if iid not in fresh:
            gw.remove_instance(iid)
            result.removed.append(iid)
        elif fresh[iid] != spec:
            gw.remove_instance(iid)
            result.changed.append(iid)
    for iid, spec in fresh.items():
        if iid not in old or iid in result.changed:
            gw.add_instance(spec)
            if iid not in old:
                result.added.append(iid)
    gw.apply_settings(new)  # the file's pools as written, SLOs, policy, admission, timeouts


async def reload_config(gw: Gateway, path: str | None = None) -> ReloadResult:
    """Read, validate and apply the config file (default: the one the gateway started
    from). Never raises for a bad file: the result says why nothing changed."""
    path = path or gw.config_path
    if path is None:
        return ReloadResult(False, "<none>", "the gateway was not started from a config file")
    async with gw.reload_lock:
        try:
            # File I/O and validation off the event loop (tokenizer checks may read files).
            loaded = await asyncio.to_thread(load_settings, path)
            new, kept = prepare(gw, loaded, path)
            keys = await asyncio.to_thread(tenant_keys, new.tenants)  # the keys file, re-read
        except (ConfigError, PolicyError, OSError, ValueError) as exc:
            log.error("config reload from %s failed, keeping the running config: %s", path, exc)
            return ReloadResult(False, path, str(exc))
        result = ReloadResult(True, path, restart_required=kept)
        gw.tenant_keys = keys  # before the settings: the tenant gate re-syncs on them
        apply(gw, new, result)
    log.info(
        "config reloaded from %s: added %s, removed %s, changed %s%s",
        path,
        result.added or "-",
        result.removed or "-",
        result.changed or "-",
        f"; restart required for {', '.join(kept)}" if kept else "",
    )
    return result
