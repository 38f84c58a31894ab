"""Several served models behind one Conductor: requests stay on their model's instances."""

from __future__ import annotations

from config.loader import settings_from_dict
from routing.conductor import Conductor
from routing.types import Decision, Rejection, RejectReason, RequestInfo


def _settings(**model_a: object):
    return settings_from_dict(
        {
            "slo": {"ttft_s": 30.0},
            "models": [
                {"name": "a", "pools": ["pa"], **model_a},
                {"name": "b", "pools": ["pb-prefill", "pb-decode"], "aliases": ["bee"]},
            ],
            "pools": [
                {
                    "name": "pa",
                    "role": "both",
                    "instances": [
                        {"id": "a0", "url": "http://127.0.0.1:9001"},
                        {"id": "a1", "url": "http://127.0.0.1:9002"},
                    ],
                },
                {
                    "name": "pb-prefill",
                    "role": "prefill",
                    "instances": [{"id": "bp0", "url": "http://127.0.0.1:9003"}],
                },
                {
                    "name": "pb-decode",
                    "role": "decode",
                    "instances": [{"id": "bd0", "url": "http://127.0.0.1:9004"}],
                },
            ],
        }
    )


def _req(rid: str, model: str | None) -> RequestInfo:
    return RequestInfo(rid, 64, (1, 2, 3, 4), 16, 0.0, model=model)


def test_instances_inherit_their_pools_model() -> None:
    s = _settings()
    assert {i.id: i.model for i in s.instances()} == {
        "a0": "a",
        "a1": "a",
        "bp0": "b",
        "bd0": "b",
    }
    assert s.served_model("bee") is s.models[1]
    assert s.served_model("nope") is None


def test_requests_are_placed_only_on_their_models_instances() -> None:
    c = Conductor(_settings())
    for k in range(20):
        d = c.schedule(_req(f"a{k}", "a"), 0.0)
        assert isinstance(d, Decision)
        assert d.prefill in ("a0", "a1") and d.decode == d.prefill
        c.dispatched(d, _req(f"a{k}", "a"), 0.0)
    d = c.schedule(_req("b", "b"), 0.0)
    assert isinstance(d, Decision)
    assert (d.prefill, d.decode) == ("bp0", "bd0")


def test_a_model_without_healthy_instances_is_unavailable_not_rerouted() -> None:
    c = Conductor(_settings())
    c.set_health("bp0", False)
    r = c.schedule(_req("b", "b"), 0.0)
    assert isinstance(r, Rejection) and r.reason is RejectReason.NO_HEALTHY_PREFILL
    assert isinstance(c.schedule(_req("a", "a"), 0.0), Decision)


def test_a_models_own_slo_applies_to_its_requests() -> None:
    c = Conductor(_settings(ttft_s=0.25, tbt_s=0.02))
    d = c.schedule(_req("a", "a"), 0.0)
    assert isinstance(d, Decision)
    assert d.slo_tbt_s == 0.02
    assert d.slo_ttft_s == 0.25
    d = c.schedule(_req("b", "b"), 0.0)
    assert isinstance(d, Decision) and d.slo_ttft_s == 30.0
