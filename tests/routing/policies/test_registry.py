from __future__ import annotations

import pytest

from routing.policies.registry import POLICIES, PolicyError, build_policy

EXPECTED = {
    "random",
    "round_robin",
    "least_load",
    "longest_prefix",
    "cache_aware",
    "kvcache_centric",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd_weighted",
    "rolling_activation",
}


def test_registry_has_exactly_the_documented_names() -> None:
    assert set(POLICIES) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_policy_builds_with_defaults(name: str) -> None:
    assert build_policy(name).name == name


def test_unknown_policy_names_the_key_and_lists_known() -> None:
    with pytest.raises(PolicyError) as err:
        build_policy("cache_awre")
    assert err.value.key == "routing.policy"
    assert "cache_aware" in str(err.value)


def test_unknown_parameter_names_the_key() -> None:
    with pytest.raises(PolicyError) as err:
        build_policy("sglang_cache_aware", {"cache_treshold": 0.5})
    assert err.value.key == "routing.params.cache_treshold"
    assert "cache_threshold" in str(err.value)


def test_parameter_type_is_checked() -> None:
    with pytest.raises(PolicyError) as err:
        build_policy("llmd_weighted", {"prefix_weight": "high"})
    assert err.value.key == "routing.params.prefix_weight"
    p = build_policy("llmd_weighted", {"prefix_weight": 5})  # int accepted for float
    assert p.wp == 5
