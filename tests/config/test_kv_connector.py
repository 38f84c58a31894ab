"""``kv_connector`` on vLLM P/D pools: inherited by instances, checked for agreement."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import ConfigError
from config.loader import settings_from_dict
from config.settings import KVConnector


def _pd(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    return {
        "pools": [
            {
                "name": "p",
                "role": "prefill",
                **prefill,
                "instances": [{"id": "p0", "url": "http://127.0.0.1:9001"}],
            },
            {
                "name": "d",
                "role": "decode",
                **decode,
                "instances": [{"id": "d0", "url": "http://127.0.0.1:9002"}],
            },
        ]
    }


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict(data, "pd.toml")
    return str(exc.value)


def test_instances_inherit_their_pools_connector() -> None:
    style = {"kv_connector": "shared_storage"}
    s = settings_from_dict(_pd(style, style))
    assert s.pools[0].kv_connector is KVConnector.SHARED_STORAGE
    assert [i.kv_connector for i in s.instances()] == [KVConnector.SHARED_STORAGE] * 2


def test_unset_means_nixl_for_both_sides() -> None:
    s = settings_from_dict(_pd({}, {"kv_connector": "nixl"}))  # unset and nixl agree
    assert [i.kv_connector for i in s.instances()] == [None, KVConnector.NIXL]


def test_prefill_and_decode_must_use_one_connector() -> None:
    msg = _error(_pd({"kv_connector": "shared_storage"}, {}))
    assert "pools[1].instances[0].kv_connector" in msg and "share one kv_connector" in msg


def test_unknown_connector_names_the_key() -> None:
    msg = _error(_pd({"kv_connector": "mooncake"}, {}))
    assert "pools[0].kv_connector" in msg and "mooncake" in msg


def test_only_vllm_instances_take_a_connector() -> None:
    data = _pd({"kv_connector": "nixl"}, {"kv_connector": "nixl"})
    for pool in data["pools"]:
        pool["instances"][0]["protocol"] = "sglang"
    msg = _error(data)
    assert "kv_connector" in msg and 'only used with protocol = "vllm"' in msg


def test_each_model_picks_its_own_connector() -> None:
    a = _pd({"kv_connector": "nixl"}, {"kv_connector": "nixl"})["pools"]
    b = _pd({"kv_connector": "shared_storage"}, {"kv_connector": "shared_storage"})["pools"]
    for pool, port in zip(b, (9003, 9004), strict=True):
        pool["name"] += "-b"
        pool["instances"][0].update(
            id=pool["instances"][0]["id"] + "b", url=f"http://127.0.0.1:{port}"
        )
    models = [{"name": "m1", "pools": ["p", "d"]}, {"name": "m2", "pools": ["p-b", "d-b"]}]
    s = settings_from_dict({"models": models, "pools": a + b})
    styles = {(i.model, i.kv_connector) for i in s.instances()}
    assert styles == {("m1", KVConnector.NIXL), ("m2", KVConnector.SHARED_STORAGE)}
