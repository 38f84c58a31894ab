"""The ``models`` table: each mistake is reported with its key."""

from __future__ import annotations

from typing import Any

import pytest

from config.errors import ConfigError
from config.loader import settings_from_dict, settings_to_dict


def _pool(name: str, port: int, role: str = "both", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "instances": [{"id": name + "0", "url": f"http://127.0.0.1:{port}", **extra}],
    }


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict(data, "m.toml")
    return str(exc.value)


def test_single_model_configs_keep_working_without_models() -> None:
    s = settings_from_dict({"pools": [_pool("w", 9001)]})
    assert s.models == () and s.instances()[0].model is None


def test_round_trip_keeps_models() -> None:
    s = settings_from_dict(
        {"models": [{"name": "m", "pools": ["w"], "ttft_s": 1.0}], "pools": [_pool("w", 9001)]}
    )
    assert settings_from_dict(settings_to_dict(s)) == s


@pytest.mark.parametrize(
    ("data", "key", "words"),
    [
        ({"models": [{"name": "m", "pools": ["nope"]}]}, "models[0].pools", "is not a pool"),
        (
            {"models": [{"name": "m", "pools": ["w"]}, {"name": "m", "pools": ["x"]}]},
            "models[1].name",
            "duplicate",
        ),
        (
            {"models": [{"name": "m", "pools": ["w"]}, {"name": "n", "pools": ["w", "x"]}]},
            "models[1].pools",
            "already serves model 'm'",
        ),
        ({"models": [{"name": "m", "pools": ["w"]}]}, "pools[1].model", "must serve a model"),
        ({"models": [{"name": "m", "pools": []}]}, "models[0].pools", "at least one pool"),
        (
            {"models": [{"name": "m", "pools": ["w", "x"], "ttft_s": -1}]},
            "models[0].ttft_s",
            "",
        ),
        (
            {"models": [{"name": "m", "pools": ["w", "x"], "lora_adapters": ["m"]}]},
            "models[0].name",
            "duplicate model name, alias or lora adapter",
        ),
        (
            {"models": [{"name": "m", "pools": ["w", "x"], "lora_adapters": [" "]}]},
            "models[0].lora_adapters[0]",
            "must not be empty",
        ),
        (
            {"models": [{"name": "m", "pools": ["w", "x"]}], "routing": {"lora_adapters": ["a"]}},
            "routing.lora_adapters",
            "list each model's adapters in models[].lora_adapters",
        ),
        ({"routing": {"lora_adapters": ["a", "a"]}}, "routing.lora_adapters[1]", "duplicate"),
    ],
)
def test_mistakes_name_their_key(data: dict[str, Any], key: str, words: str) -> None:
    message = _error({**data, "pools": [_pool("w", 9001), _pool("x", 9002)]})
    assert key in message and "m.toml" in message
    assert words.lower() in message.lower()


def test_an_instance_cannot_claim_another_model() -> None:
    message = _error(
        {
            "models": [{"name": "m", "pools": ["w"]}, {"name": "n", "pools": ["x"]}],
            "pools": [_pool("w", 9001, model="n"), _pool("x", 9002)],
        }
    )
    assert "pools[0].instances[0].model" in message


def test_a_disaggregated_model_needs_both_roles() -> None:
    message = _error(
        {
            "models": [{"name": "m", "pools": ["p"]}, {"name": "n", "pools": ["d"]}],
            "pools": [_pool("p", 9001, "prefill"), _pool("d", 9002, "decode")],
        }
    )
    assert "needs both a prefill and a decode pool" in message
