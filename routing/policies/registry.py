"""Policy registry: a new policy is one class plus one line here."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from config.errors import KvgateError
from routing.policies.base import Policy
from routing.policies.ecoserve import RollingActivationPolicy
from routing.policies.mooncake import CacheAwarePolicy, KVCacheCentricPolicy
from routing.policies.peers import DynamoKVPolicy, LLMDWeightedPolicy, SGLangCacheAwarePolicy
from routing.policies.simple import (
    LeastLoadPolicy,
    LongestPrefixPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)

POLICIES: Mapping[str, type] = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        RoundRobinPolicy,
        LeastLoadPolicy,
        LongestPrefixPolicy,
        CacheAwarePolicy,
        KVCacheCentricPolicy,
        SGLangCacheAwarePolicy,
        DynamoKVPolicy,
        LLMDWeightedPolicy,
        RollingActivationPolicy,
    )
}


class PolicyError(KvgateError, ValueError):
    """A policy name or parameter is wrong; ``key`` is the config key path."""

    def __init__(self, key: str, value: Any, message: str) -> None:
        super().__init__(f"{key} = {value!r}: {message}")
        self.key, self.value, self.detail = key, value, message


def policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise PolicyError("routing.policy", name, f"unknown policy (known: {known})") from None


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate a policy, validating its parameters against its constructor signature."""
    cls = policy_class(name)
    sig = inspect.signature(cls.__init__)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    accepted = {k: p for k, p in sig.parameters.items() if k != "self" and p.kind in named}
    for key, value in (params or {}).items():
        param = accepted.get(key)
        if param is None:
            known = ", ".join(accepted) or "none"
            raise PolicyError(
                f"routing.params.{key}", value, f"not a parameter of {name} (known: {known})"
            )
        default = param.default
        if default is not inspect.Parameter.empty and not _same_kind(default, value):
            raise PolicyError(f"routing.params.{key}", value, f"expected {type(default).__name__}")
    return cls(**dict(params or {}))


def _same_kind(default: Any, value: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))
