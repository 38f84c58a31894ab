"""KVIndex scenarios: tiers, prediction expiry, LRU and demotion, events, slot reuse, speed.
(The property tests against a reference model are in test_kv_index_model.py.)"""

from __future__ import annotations

import random
import time

import pytest

from routing.kv_index import KVIndex
from routing.types import (
    EMPTY_MATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Tier,
)

# --- a deliberately naive reference model (lists, per-instance scans) -----------------------


def _index(ttl: float | None = None, **caps: tuple[int, int]) -> KVIndex:
    idx = KVIndex(predicted_ttl_s=ttl)
    for iid, (gpu, host) in caps.items():
        idx.add_instance(iid, gpu, host)
    return idx


def test_match_prefix_lengths_on_all_tiers() -> None:
    idx = _index(a=(10, 10), b=(10, 0), c=(10, 0))
    idx.record_route("a", [1, 2], 0.0)
    idx.apply("a", BlockStored((3, 4), Tier.HOST), 0.0)
    idx.record_route("b", [1, 2, 3, 4, 5], 0.0)
    idx.apply_store(BlockStored((1, 2, 3)))
    m = idx.match([1, 2, 3, 4, 5, 6], 0.0)
    assert m.gpu_blocks == {"a": 2, "b": 5}
    assert m.local_blocks == {"a": 4, "b": 5}
    assert m.store_blocks == 3
    assert (m.best_blocks, m.best_holders) == (5, ("b",))
    assert m.local("c") == 0 and m.gpu("a") == 2
    assert idx.match([], 0.0) == EMPTY_MATCH
    assert idx.match([99, 1], 0.0) == EMPTY_MATCH


def test_best_holders_in_registration_order_after_slot_reuse() -> None:
    idx = _index(a=(10, 0), b=(10, 0), c=(10, 0))
    idx.remove_instance("a")
    idx.add_instance("d", 10, 0)  # reuses a's slot (the lowest bit) but registers last
    for iid in ("b", "c", "d"):
        idx.record_route(iid, [1, 2, 3], 0.0)
    assert idx.match([1, 2, 3], 0.0).best_holders == ("b", "c", "d")
    assert idx.instances() == ("b", "c", "d")


def test_early_stop_does_not_read_past_the_last_holder() -> None:
    idx = _index(a=(10, 0))
    idx.record_route("a", [1, 2], 0.0)

    class Prompt(list[int]):
        reads = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            for x in super().__iter__():
                Prompt.reads += 1
                yield x

    m = idx.match(Prompt([1, 2, 3, *range(10, 1000)]), 0.0)
    assert m.local_blocks == {"a": 2}
    assert Prompt.reads <= 4  # 1, 2, then 3 drops everyone


def test_predicted_entries_expire_unless_confirmed() -> None:
    idx = _index(ttl=5.0, a=(10, 0))
    idx.record_route("a", [1, 2, 3], now=0.0)
    assert idx.is_predicted("a", 1)
    assert idx.match([1, 2, 3], 4.9).local_blocks == {"a": 3}
    idx.apply("a", BlockStored((1, 2)), 1.0)  # the engine confirms two of them
    assert not idx.is_predicted("a", 1) and idx.is_predicted("a", 3)
    assert idx.match([1, 2, 3], 5.0).local_blocks == {"a": 2}  # expiry <= now does not count
    assert not idx.holds("a", 3)
    assert idx.expire(100.0) == 0
    assert idx.match([1, 2, 3], 100.0).local_blocks == {"a": 2}  # confirmed: permanent
    assert len(idx) == 2


def test_rerouting_does_not_extend_a_prediction() -> None:
    idx = _index(ttl=5.0, a=(10, 0))
    idx.record_route("a", [1], now=0.0)
    idx.record_route("a", [1, 2], now=4.0)
    assert idx.match([1, 2], 5.0).local_blocks == {}  # block 1 expired at 5, 2 lives on
    assert idx.holds("a", 2) and not idx.holds("a", 1)
    assert idx.expire(9.0) == 1 and len(idx) == 0


def test_repredicted_block_gets_its_own_expiry() -> None:
    idx = _index(ttl=1.0, a=(10, 0))
    idx.record_route("a", [1], now=0.0)
    idx.apply("a", BlockRemoved((1,)), 0.5)  # the engine dropped it...
    idx.record_route("a", [1], now=0.5)  # ...and a new request predicts it again
    assert idx.expire(1.0) == 0  # the first prediction's expiry no longer applies
    assert idx.match([1], 1.0).local_blocks == {"a": 1}
    assert idx.expire(1.5) == 1 and not idx.holds("a", 1)


def test_expire_counts_and_ignores_removed_instances() -> None:
    idx = _index(ttl=1.0, a=(10, 0), b=(10, 0))
    idx.record_route("a", [1, 2], 0.0)
    idx.record_route("b", [1, 2, 3], 0.0)
    idx.remove_instance("b")
    idx.add_instance("b", 10, 0)  # same id, new registration: old predictions are not its own
    idx.record_route("b", [7], 0.5)
    assert idx.expire(1.0) == 2
    assert idx.holds("b", 7) and len(idx) == 1
    assert idx.expire(1.5) == 1 and len(idx) == 0


def test_no_ttl_means_confirmed() -> None:
    idx = _index(ttl=None, a=(10, 0))
    idx.record_route("a", [1, 2], 0.0)
    assert not idx.is_predicted("a", 1)
    assert idx.expire(1e9) == 0
    assert idx.match([1, 2], 1e9).local_blocks == {"a": 2}


def test_lru_eviction_follows_touch_order() -> None:
    idx = _index(a=(3, 0))
    for h in (1, 2, 3):
        idx.record_route("a", [h], 0.0)
    idx.touch("a", [1])  # 2 is now the least recently used
    idx.record_route("a", [4], 0.0)
    assert [h for h in (1, 2, 3, 4) if idx.holds("a", h)] == [1, 3, 4]
    idx.apply("a", BlockStored((5,)), 0.0)  # events touch too: 3 goes next
    assert [h for h in (1, 3, 4, 5) if idx.holds("a", h)] == [1, 4, 5]


def test_prompt_does_not_evict_itself_and_keeps_its_prefix() -> None:
    idx = _index(a=(4, 0))
    idx.record_route("a", [1, 2], 0.0)
    idx.record_route("a", [10, 11, 12], 0.0)
    assert idx.match([10, 11, 12], 0.0).gpu_blocks == {"a": 3}  # 2 (older) was evicted
    assert idx.holds("a", 1) and not idx.holds("a", 2)  # the older prompt's tail went first
    idx.record_route("a", [20, 21, 22, 23, 24, 25], 0.0)  # longer than the capacity
    assert idx.match([20, 21, 22, 23, 24, 25], 0.0).gpu_blocks == {"a": 4}
    assert idx.blocks_held("a") == (4, 0)


def test_demotion_to_host_and_host_lru() -> None:
    idx = _index(a=(2, 2))
    idx.record_route("a", [1, 2], 0.0)
    idx.record_route("a", [3, 4], 0.0)  # 1, 2 demoted (tail 2 first)
    m = idx.match([1, 2], 0.0)
    assert m.gpu_blocks == {} and m.local_blocks == {"a": 2}
    assert idx.holds("a", 1, Tier.HOST) and not idx.holds("a", 1, Tier.GPU)
    idx.record_route("a", [5], 0.0)  # 4 demoted; host over capacity: drops 2 (its LRU)
    assert idx.blocks_held("a") == (2, 2)
    assert [h for h in range(1, 6) if idx.holds("a", h, Tier.HOST)] == [1, 4]
    # A hit on the host copy loads it back to GPU; the host copy stays (HiCache keeps it).
    idx.record_route("a", [1], 0.0)
    assert idx.holds("a", 1, Tier.GPU) and idx.holds("a", 1, Tier.HOST)


def test_without_host_tier_evicted_blocks_are_dropped() -> None:
    idx = _index(a=(2, 0))
    idx.record_route("a", [1, 2, 3], 0.0)
    assert idx.blocks_held("a") == (2, 0)
    assert len(idx) == 2 and not idx.holds("a", 3)


def test_events_remove_and_clear() -> None:
    idx = _index(a=(10, 10), b=(10, 0))
    idx.apply("a", BlockStored((1, 2, 3)), 0.0)
    idx.apply("a", BlockStored((1, 2), Tier.HOST), 0.0)
    idx.apply("b", BlockStored((1,)), 0.0)
    idx.apply("a", BlockRemoved((1,)), 0.0)  # GPU copy gone, host copy remains
    assert idx.match([1, 2, 3], 0.0).gpu_blocks == {"b": 1}
    assert idx.match([1, 2, 3], 0.0).local_blocks == {"a": 3, "b": 1}
    idx.apply("a", BlockRemoved((1,), Tier.HOST), 0.0)
    assert idx.match([1, 2, 3], 0.0).local_blocks == {"b": 1}
    idx.apply("a", AllBlocksCleared(), 0.0)
    assert idx.blocks_held("a") == (0, 0) and len(idx) == 1
    idx.apply("a", BlockStored((9,), Tier.STORE), 0.0)  # an instance writing to the store
    assert idx.holds("x", 9, Tier.STORE) and idx.store_blocks() == 1


def test_store_tier() -> None:
    idx = _index(a=(10, 0))
    idx.apply_store(BlockStored((1, 2, 3)))
    idx.record_route("a", [1], 0.0)
    assert idx.match([1, 2, 3, 4], 0.0).store_blocks == 3
    idx.apply_store(BlockRemoved((2,)))
    assert idx.match([1, 2, 3], 0.0).store_blocks == 1
    assert len(idx) == 2
    idx.apply_store(AllBlocksCleared())
    assert len(idx) == 1 and idx.match([1], 0.0).store_blocks == 0


def test_unknown_instance_events_are_counted_and_ignored() -> None:
    idx = _index(a=(10, 0))
    idx.apply("zz", BlockStored((1,)), 0.0)
    idx.apply("zz", AllBlocksCleared(), 0.0)
    assert idx.unknown_instance_events == 2 and len(idx) == 0
    idx.record_route("zz", [1], 0.0)  # routes / touches to unknown instances are no-ops
    idx.touch("zz", [1])
    assert len(idx) == 0


def test_bit_reuse_does_not_leak_old_holdings() -> None:
    idx = _index(ttl=1.0, a=(10, 4), b=(10, 0))
    idx.record_route("a", [1, 2, 3], 0.0)
    idx.apply("a", BlockStored((8,), Tier.HOST), 0.0)
    idx.remove_instance("a")
    assert len(idx) == 0
    idx.add_instance("c", 10, 0)  # takes a's slot
    assert idx.match([1, 2, 3], 0.0) == EMPTY_MATCH
    assert not idx.holds("c", 1) and not idx.holds("c", 8)
    idx.record_route("c", [1], 0.5)
    idx.expire(1.0)  # a's old prediction entries must not touch c's block
    assert idx.match([1, 2], 1.0).local_blocks == {"c": 1}


def test_validation() -> None:
    with pytest.raises(ValueError):
        KVIndex(predicted_ttl_s=0.0)
    idx = _index(a=(1, 0))
    with pytest.raises(ValueError):
        idx.add_instance("a", 1)
    with pytest.raises(ValueError):
        idx.add_instance("b", -1)
    with pytest.raises(KeyError):
        idx.remove_instance("nope")
    assert "a" in idx and "b" not in idx


def test_many_instances_coincident_drops() -> None:
    """More than 64 instances (multi-word masks) and many holders dropping at one block."""
    idx = KVIndex()
    prompt = list(range(50))
    for i in range(100):
        idx.add_instance(f"i{i}", 100, 10)
        idx.record_route(f"i{i}", prompt[: i % 7], 0.0)
    idx.apply_store(BlockStored(tuple(prompt[:3])))
    m = idx.match(prompt, 0.0)
    assert m.local_blocks == {f"i{i}": i % 7 for i in range(100) if i % 7}
    assert m.gpu_blocks == m.local_blocks
    assert m.store_blocks == 3 and m.best_blocks == 6
    assert m.best_holders == tuple(f"i{i}" for i in range(100) if i % 7 == 6)


def test_match_speed_256_blocks_64_instances() -> None:
    rng = random.Random(0)
    idx = KVIndex()
    prompt = [rng.getrandbits(63) for _ in range(256)]
    for i in range(64):
        idx.add_instance(f"i{i}", 2000, 0)
        idx.apply(f"i{i}", BlockStored(tuple(rng.getrandbits(63) for _ in range(1000))), 0.0)
        idx.record_route(f"i{i}", prompt[: rng.randrange(257)], 0.0)
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter()
        idx.match(prompt, 1.0)
        best = min(best, time.perf_counter() - t0)
    assert best < 1e-3  # ~35 us measured; generous for slow CI machines
