"""bench/replicas.py writes configs that validate; bench/replica_exchange_cost.py measures."""

from __future__ import annotations

import argparse
import tomllib

from bench.replica_exchange_cost import measure
from bench.replicas import _config
from config.loader import settings_from_dict


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        ttft_slo=2.0,
        tbt_slo=0.1,
        policy="kvcache_centric",
        admission="predictive",
        profile="llama3-8b-h100-tp1",
        publish_interval=0.05,
        no_rotate_ties=False,
    )


def test_replica_configs_validate_with_and_without_the_exchange() -> None:
    engines = {
        "p0": ("http://127.0.0.1:45300", "tcp://127.0.0.1:45301"),
        "d0": ("http://127.0.0.1:45302", "tcp://127.0.0.1:45303"),
    }
    ex = {"bind": "tcp://127.0.0.1:45304", "peers": ["tcp://127.0.0.1:45305"]}
    on = settings_from_dict(tomllib.loads(_config(_args(), engines, 45306, "r0", ex)))
    assert on.replicas.enabled and on.replicas.peers == ("tcp://127.0.0.1:45305",)
    assert [i.id for i in on.instances()] == ["p0", "d0"]
    assert on.instances()[0].kv_events_endpoint == "tcp://127.0.0.1:45301"
    assert on.replicas.rotate_ties
    unrotated = _config(
        argparse.Namespace(**{**vars(_args()), "no_rotate_ties": True}), engines, 45306, "r0", ex
    )
    assert not settings_from_dict(tomllib.loads(unrotated)).replicas.rotate_ties
    off = settings_from_dict(tomllib.loads(_config(_args(), engines, 45306, "r0", {})))
    assert not off.replicas.enabled


def test_exchange_cost_grows_with_the_work_in_flight() -> None:
    small, large = measure(10, instances=2, seconds=0.05), measure(100, instances=2, seconds=0.05)
    assert 0 < small["payload_bytes"] < large["payload_bytes"]
    assert small["decode_merge_ms"] > 0 and large["snapshot_encode_ms"] > 0
