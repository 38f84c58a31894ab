"""Gateway runtime pieces that need no network: slot pinning and its cache-view eviction, what
the engines' metrics change, and the silence timeout."""

from __future__ import annotations

from dataclasses import replace

from backends.prometheus import EngineLoad
from config.settings import InstanceSettings, PoolSettings, Role, Settings
from gateway.runtime import Gateway
from routing.types import BlockStored, Decision, RequestInfo


def _gateway(affinity: bool = True, probe: bool = False) -> Gateway:
    """``probe`` off: pinning as for llama-servers known to run with --cache-ram 0."""
    base = Settings()
    inst = InstanceSettings("l0", "http://127.0.0.1:1", Role.BOTH)
    routing = replace(
        base.routing, llamacpp_slot_affinity=affinity, llamacpp_host_cache_probe=probe
    )
    return Gateway(
        replace(
            base,
            routing=routing,
            pools=(PoolSettings("llama", Role.BOTH, (inst,)),),
        )
    )


def _load(slots: int | None, capacity: int | None = None) -> EngineLoad:
    return EngineLoad("l0", 0.0, engine="llamacpp", slots=slots, token_capacity=capacity)


def test_slots_from_metrics_enable_pinning_and_capacity_replaces_the_profile() -> None:
    gw = _gateway()
    assert gw.pin_slot("r0", "l0", (1, 2)) is None  # no slot layout read yet: the engine picks
    gw._apply_loads({"l0": _load(2, 8192)})
    assert len(gw.slot_book.instances["l0"].slots) == 2
    assert gw.conductor.instances["l0"].capacity_tokens == 8192
    assert gw.pin_slot("r1", "l0", (1, 2)) in (0, 1)
    gw.unpin_slot("r1")
    assert gw.slot_book.held == 0


def test_slots_bound_the_sequences_unless_the_config_names_a_max_batch() -> None:
    gw = _gateway()
    profile_max = gw.conductor.instances["l0"].max_batch
    assert profile_max == gw.conductor.instances["l0"].predictors.profile.max_batch
    gw._apply_loads({"l0": _load(2)})
    assert gw.conductor.instances["l0"].max_batch == 2  # llama-server -np 2
    base = Settings()
    inst = InstanceSettings("l0", "http://127.0.0.1:1", Role.BOTH, max_batch=5)
    named = Gateway(replace(base, pools=(PoolSettings("llama", Role.BOTH, (inst,)),)))
    named._apply_loads({"l0": _load(2)})
    assert named.conductor.instances["l0"].max_batch == 5


def test_with_the_probe_on_no_slot_is_pinned_before_the_engine_answered() -> None:
    gw = _gateway(probe=True)
    gw._apply_loads({"l0": _load(2)})  # no session yet: nothing asked, nothing booked
    assert gw.pin_slot("r1", "l0", (1, 2)) is None
    assert "l0" not in gw.slot_book.instances


def test_affinity_off_leaves_slot_choice_to_the_engine() -> None:
    gw = _gateway(affinity=False)
    gw._apply_loads({"l0": _load(2)})
    assert gw.pin_slot("r1", "l0", (1, 2)) is None


def test_a_reused_slot_drops_the_prefix_it_held_from_the_cache_view() -> None:
    gw = _gateway()
    gw._apply_loads({"l0": _load(1)})  # one slot: every new prompt overwrites the last
    old, new = (11, 12, 13), (21, 22)
    gw.conductor.index.apply("l0", BlockStored(old), 0.0)
    assert gw.pin_slot("a", "l0", old) == 0
    gw.unpin_slot("a")
    assert gw.pin_slot("b", "l0", new) == 0
    gw.unpin_slot("b")
    assert not any(gw.conductor.index.holds("l0", h) for h in old)
    evicted = gw.metrics.registry.get_sample_value("kvgate_cache_view_slot_evicted_blocks_total")
    assert evicted == 3


def test_silence_timeout_is_a_multiple_of_prediction_or_slo_within_bounds() -> None:
    gw = _gateway()
    srv = gw.settings.server
    d = gw.conductor.schedule(RequestInfo("r", 100, (), 16, 0.0), 0.0)
    assert isinstance(d, Decision)
    slow = replace(d, predicted_ttft_s=1e6)
    fast = replace(d, predicted_ttft_s=0.0, slo_ttft_s=0.0)
    assert gw.silence_timeout(slow) == srv.silence_max_s
    assert gw.silence_timeout(fast) == srv.silence_min_s
    mid = replace(d, predicted_ttft_s=0.0, slo_ttft_s=30.0)
    want = min(max(srv.silence_slo_factor * 30.0, srv.silence_min_s), srv.silence_max_s)
    assert gw.silence_timeout(mid) == want
