"""Re-implementations of peer routers' placement rules, for side-by-side comparison.

One module per peer (each docstring cites the upstream file and commit); audit notes and
measurements in docs/peer-fidelity.md. Their shipped overload control is admission mode
``peer`` (routing/policies/peer_overload.py).
"""

from __future__ import annotations

from routing.policies.peer_dynamo import DynamoKVPolicy
from routing.policies.peer_llmd import LLMDWeightedPolicy
from routing.policies.peer_sglang import SGLangCacheAwarePolicy

__all__ = ["DynamoKVPolicy", "LLMDWeightedPolicy", "SGLangCacheAwarePolicy"]
