"""KvEventFeeds: engine events reach the Conductor's KV index in the instance's own key space;
a resync (events lost) clears the instance's view; a removed instance's late batch is ignored.
Real Conductor, real EngineKeyMap, real hasher; no sockets (the subscriber is tested in
tests/backends/test_kv_events*.py)."""

from __future__ import annotations

from backends.engine_events import EngineBlockRemoved, EngineBlockStored
from backends.engine_keys import EngineKeyMap
from gateway.kv_feeds import KvEventFeeds
from routing.hashing import BlockHasher
from tests.routing.fleet import BLOCK, make_conductor


def _feeds() -> tuple[KvEventFeeds, object]:
    conductor = make_conductor()
    feeds = KvEventFeeds(conductor, lambda: 1.0, lambda iid: BlockHasher(BLOCK))
    for iid in ("p0", "p1"):  # as subscribe() does, without a socket
        feeds.keys[iid] = EngineKeyMap(BlockHasher(BLOCK))
    return feeds, conductor


def _stored(first_hash: int, blocks: int) -> EngineBlockStored:
    return EngineBlockStored(
        block_hashes=tuple(range(first_hash, first_hash + blocks)),
        parent_block_hash=None,
        token_ids=tuple(range(blocks * BLOCK)),
        block_size=BLOCK,
    )


def test_events_land_in_the_instance_view_and_removals_take_blocks_out() -> None:
    feeds, conductor = _feeds()
    feeds._on_events("p0", [_stored(500, 3)])
    assert conductor.index.blocks_held("p0") == (3, 0)
    assert conductor.index.blocks_held("p1") == (0, 0)
    feeds._on_events("p0", [EngineBlockRemoved(block_hashes=(502,))])
    assert conductor.index.blocks_held("p0") == (2, 0)


def test_a_resync_clears_what_kvgate_believed_the_instance_holds() -> None:
    feeds, conductor = _feeds()
    feeds._on_events("p0", [_stored(500, 3)])
    feeds._on_resync("p0")
    assert conductor.index.blocks_held("p0") == (0, 0)
    assert len(feeds.keys["p0"]) == 0  # the engine-hash map forgot them too


def test_a_removed_instance_ignores_a_late_batch() -> None:
    feeds, conductor = _feeds()
    feeds.remove("p1")
    feeds._on_events("p1", [_stored(900, 2)])  # in flight while the instance went away
    assert "p1" not in feeds.keys and not feeds.sends_events("p1")
    assert conductor.index.blocks_held("p1") == (0, 0)
