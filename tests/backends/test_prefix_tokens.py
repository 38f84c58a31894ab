"""The prefix token store: block hash -> the token prefix it stands for, bounded in bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from backends.prefix_tokens import PrefixTokenStore
from routing.hashing import BlockHasher
from routing.prompt_encoder import ApproxPromptEncoder, PromptTokens
from routing.tokenizer import ApproxTokenizer, pack_token_ids

BS = 4
HASHER = BlockHasher(BS)


def _keep(store: PrefixTokenStore, ids: list[int], **kw: Any) -> tuple[int, ...]:
    hashes = HASHER.hash_tokens(ids)
    store.remember(hashes, pack_token_ids(ids), **kw)
    return hashes


def test_lookup_cuts_the_prompt_at_the_block_of_the_hash() -> None:
    store = PrefixTokenStore(BS)
    ids = list(range(100, 114))  # 3 full blocks + 2 tokens that no engine caches
    hashes = _keep(store, ids, model="tiny", cache_salt="s1")
    assert len(hashes) == 3
    for i, h in enumerate(hashes):
        found = store.lookup(h)
        assert found is not None
        assert found.token_ids() == ids[: (i + 1) * BS]
        assert found.n_tokens == (i + 1) * BS
        assert (found.model, found.cache_salt) == ("tiny", "s1")
    assert store.lookup(12345) is None


def test_a_prompt_inside_a_kept_one_adds_nothing() -> None:
    store = PrefixTokenStore(BS)
    _keep(store, list(range(16)))
    before = store.bytes
    _keep(store, list(range(8)))
    assert (len(store), store.bytes) == (1, before)


def test_a_prompt_that_extends_a_kept_one_replaces_it() -> None:
    store = PrefixTokenStore(BS)
    first = _keep(store, list(range(8)))
    longer = _keep(store, list(range(16)))
    assert len(store) == 1
    assert store.lookup(first[-1]).token_ids() == list(range(8))  # type: ignore[union-attr]
    assert store.lookup(longer[-1]).token_ids() == list(range(16))  # type: ignore[union-attr]


def test_prompts_that_share_a_prefix_keep_both_tails() -> None:
    store = PrefixTokenStore(BS)
    shared = list(range(8))
    a = _keep(store, [*shared, 50, 51, 52, 53])
    b = _keep(store, [*shared, 60, 61, 62, 63])
    assert len(store) == 2
    assert a[1] == b[1] and a[2] != b[2]
    assert store.lookup(a[2]).token_ids()[-4:] == [50, 51, 52, 53]  # type: ignore[union-attr]
    assert store.lookup(b[2]).token_ids()[-4:] == [60, 61, 62, 63]  # type: ignore[union-attr]
    assert store.lookup(a[1]).token_ids() == shared  # type: ignore[union-attr]


def test_bounded_in_bytes_least_recently_used_first() -> None:
    one = PrefixTokenStore(BS)
    _keep(one, list(range(1000, 1016)))
    cost = one.bytes  # what one 4-block prompt is charged
    store = PrefixTokenStore(BS, max_bytes=2 * cost)
    a = _keep(store, list(range(1000, 1016)))
    b = _keep(store, list(range(2000, 2016)))
    assert store.lookup(a[-1]) is not None  # a is now the most recently used
    c = _keep(store, list(range(3000, 3016)))
    assert len(store) == 2 and store.bytes <= store.max_bytes and store.evicted == 1
    assert store.lookup(b[-1]) is None and b[0] not in store
    assert store.lookup(a[-1]) is not None and store.lookup(c[-1]) is not None


def test_eviction_keeps_blocks_a_newer_prompt_shares() -> None:
    one = PrefixTokenStore(BS)
    _keep(one, list(range(12)))
    store = PrefixTokenStore(BS, max_bytes=2 * one.bytes)
    old = _keep(store, [*range(8), 70, 71, 72, 73])
    new = _keep(store, [*range(8), 80, 81, 82, 83])
    _keep(store, list(range(500, 512)))  # evicts `old`
    assert store.lookup(old[2]) is None
    assert store.lookup(new[1]).token_ids() == list(range(8))  # type: ignore[union-attr]


def test_a_prompt_larger_than_the_budget_is_not_kept() -> None:
    store = PrefixTokenStore(BS, max_bytes=64)
    hashes = _keep(store, list(range(64)))
    assert len(store) == 0 and store.bytes == 0 and store.lookup(hashes[-1]) is None


def test_too_few_packed_tokens_for_the_hashes_is_an_error() -> None:
    store = PrefixTokenStore(BS)
    hashes = HASHER.hash_tokens(list(range(8)))
    with pytest.raises(ValueError, match="need 32 bytes"):
        store.remember(hashes, pack_token_ids(range(5)))


class _ExactEncoder:
    """An engine-exact encoder as far as the store cares: ``exact`` and the ids it returns."""

    exact = True

    def encode(self, path: str, body: Mapping[str, Any]) -> PromptTokens:
        ids = [ord(c) for c in str(body.get("prompt") or body.get("messages"))]
        return PromptTokens(pack_token_ids(ids), len(ids), body.get("cache_salt"))


def test_requests_are_kept_only_with_the_engines_token_ids() -> None:
    store = PrefixTokenStore(BS)
    approx = ApproxPromptEncoder(ApproxTokenizer())
    text = {"model": "tiny", "prompt": "x" * 64}
    ids = {"model": "tiny", "prompt": list(range(300, 316)), "cache_salt": "u1"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi" * 40}]}
    completions, chat_path = "/v1/completions", "/v1/chat/completions"

    def keep(path: str, body: dict, hashes: tuple[int, ...], encoder) -> bool:
        tokens = encoder.encode(path, body)  # what parse_request hands on
        return store.remember_request(path, body, hashes, tokens, encoder.exact)

    # Approximate ids would warm the engine's cache with tokens no request ever sends.
    assert not keep(completions, text, HASHER.hash_tokens([1] * 16), approx)
    assert not keep(chat_path, chat, HASHER.hash_tokens([1] * 16), approx)
    assert len(store) == 0
    # Token-id prompts are the engine's ids whatever the encoder.
    id_hashes = HASHER.hash_tokens(ids["prompt"])
    assert keep(completions, ids, id_hashes, approx)
    found = store.lookup(id_hashes[-1])
    assert found is not None
    assert (found.token_ids(), found.model, found.cache_salt) == (ids["prompt"], "tiny", "u1")
    # An engine-exact encoder's ids are kept for chat and text prompts too.
    exact = _ExactEncoder()
    n = len(exact.encode(chat_path, chat).packed) // 4
    chat_hashes = HASHER.hash_tokens(list(range(n)))
    assert keep(chat_path, chat, chat_hashes, exact)
    assert store.lookup(chat_hashes[-1]) is not None
    # A body whose prompt is not a prompt is skipped, not raised.
    tokens = approx.encode(completions, ids)
    assert not store.remember_request(completions, {"prompt": ""}, id_hashes, tokens, False)
