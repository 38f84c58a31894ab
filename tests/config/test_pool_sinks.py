"""Which replication sink a pool may use (config/fleet_checks.py ``check_pool_sinks``): none on
a decode pool, and no copy through a connector's store onto llama.cpp, which has no connector."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import ConfigError
from config.loader import settings_from_dict
from config.settings import ReplicationSink


def _fleet(engine: str, pool_sink: str | None, default: str = "dry_run") -> dict[str, Any]:
    pool: dict[str, Any] = {
        "name": "both",
        "role": "both",
        "instances": [{"id": "e0", "url": "http://127.0.0.1:9001", "engine": engine}],
    }
    if pool_sink is not None:
        pool["replication_sink"] = pool_sink
    return {"replication": {"sink": default}, "pools": [pool]}


def test_a_vllm_pool_may_copy_through_its_connectors_store() -> None:
    s = settings_from_dict(_fleet("vllm", "connector_store"), "fleet.toml")
    assert s.pools[0].replication_sink is ReplicationSink.CONNECTOR_STORE
    s = settings_from_dict(_fleet("auto", None, "connector_store"), "fleet.toml")
    assert s.replication.sink is ReplicationSink.CONNECTOR_STORE


@pytest.mark.parametrize(
    ("pool_sink", "default", "key"),
    [
        ("connector_store", "dry_run", "pools[0].replication_sink"),
        (None, "connector_store", "replication.sink"),
    ],
)
def test_llamacpp_has_no_connector_store_and_the_error_names_the_setting(
    pool_sink: str | None, default: str, key: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict(_fleet("llamacpp", pool_sink, default), "fleet.toml")
    text = str(exc.value)
    assert key in text and "fleet.toml" in text
    assert "llama.cpp instances, which have none: use 'warmup' there" in text
    settings_from_dict(_fleet("llamacpp", "warmup", default), "fleet.toml")  # the way out
