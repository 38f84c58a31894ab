"""routing/adapter_loads.py: kvgate's book of the adapters an engine holds in host memory, and
the load time learned from first tokens."""

from __future__ import annotations

import pytest

from routing.adapter_loads import AdapterLoads, ResidualMean


def test_an_early_mean_is_the_plain_mean_then_it_weighs_recent_samples() -> None:
    m = ResidualMean(weight=0.5)
    m.add(1.0)
    m.add(3.0)
    assert m.value == pytest.approx(2.0)  # 1/n beats the weight for the first samples
    m.add(3.0)
    assert m.value == pytest.approx(2.5)  # then the weight: 2 + (3 - 2) * 0.5
    assert m.n == 3


def test_an_engine_holds_its_max_loras_last_adapters_unless_told_more() -> None:
    loads = AdapterLoads()
    loads.ran("e0", "a", max_loras=1)
    loads.ran("e0", "b", max_loras=1)
    assert not loads.resident("e0", "a")  # vLLM's default --max-cpu-loras = --max-loras
    assert loads.resident("e0", "b")
    assert not loads.resident("e1", "b")  # another engine: never ran it
    more = AdapterLoads(cpu_adapters=2)
    for adapter in ("a", "b", "a", "c"):  # "a" used again: "b" is the oldest
        more.ran("e0", adapter, max_loras=1)
    assert [more.resident("e0", x) for x in "abc"] == [True, False, True]
    more.forget("e0")
    assert not more.resident("e0", "a")


def test_the_load_is_what_cold_first_tokens_wait_beyond_the_resident_ones() -> None:
    loads = AdapterLoads(weight=0.2)
    assert loads.load_s() == 0.0  # nothing seen: no charge (the requests still say cold)
    loads.observe(0.5, charged_s=0.0)  # cold, 0.5 s late
    assert loads.load_s() == pytest.approx(0.5)
    loads.observe(0.2, charged_s=None)  # resident requests are late too: the predictor errs
    assert loads.load_s() == pytest.approx(0.3)
    loads.observe(0.0, charged_s=0.3)  # charged 0.3 s and on time: the load was 0.3 s
    assert loads.load_s() == pytest.approx((0.5 + 0.3) / 2 - 0.2)
    loads.observe(5.0, charged_s=None)  # resident requests later than cold ones: no negative
    loads.observe(5.0, charged_s=None)
    assert loads.load_s() == 0.0
    assert loads.as_dict() == {
        "load_s": 0.0,
        "configured": False,
        "cold_samples": 2,
        "resident_samples": 3,
    }


def test_a_configured_load_time_is_used_as_given() -> None:
    loads = AdapterLoads(fixed_s=1.5)
    loads.observe(9.0, charged_s=1.5)
    assert loads.load_s() == 1.5


def test_use_adapters_keeps_the_most_recent_within_capacity_or_all() -> None:
    from collections import OrderedDict

    from routing.adapter_loads import use_adapters

    held: OrderedDict[str, None] = OrderedDict()
    use_adapters(held, ("a", "b", "c", "a"), 2)
    assert list(held) == ["c", "a"]
    use_adapters(held, ("d", "e"), None)
    assert list(held) == ["c", "a", "d", "e"]
