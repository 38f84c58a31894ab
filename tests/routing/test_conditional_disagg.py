"""Conditional disaggregation: local prefill on the decode instance, pinned on small cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.errors import ConfigError
from config.loader import settings_from_dict
from config.settings import SLOSettings
from routing.admission import EffectiveSLO, resolve_slo
from routing.conditional_disagg import LOCAL_REASON, local_prefill
from routing.conductor import Conductor
from routing.estimates import PrefillOption
from routing.instance_books import DecodeWork
from routing.types import Decision
from tests.routing.fleet import busy, fleet_settings, prompt, request


def conductor(on: bool = True, tbt_s: float = 0.1) -> Conductor:
    s = fleet_settings(prefill=2, decode=1, slo=SLOSettings(ttft_s=30.0, tbt_s=tbt_s))
    return Conductor(replace(s, routing=replace(s.routing, conditional_disagg=on)))


def remote(c: Conductor, ttft_s: float) -> PrefillOption:
    return PrefillOption(c.instances["p0"], ttft_s, ttft_s, 0.0, 0.0, 0.0, 0, 0)


def fill(c: Conductor, n: int, context: int) -> None:
    d0 = c.instances["d0"]
    for i in range(n):
        d0.add_incoming(DecodeWork(f"old{i}", context, 1000, 0.0))
        d0.start_decode(f"old{i}", 0.0)


def test_idle_decode_instance_takes_a_short_prompt_when_the_prefill_pool_is_slower() -> None:
    c = conductor()
    req = request("r", prompt(1, 4))  # 64 tokens
    slo = resolve_slo(req, c.settings.slo)
    opt = local_prefill(req, c.instances["d0"], remote(c, 2.0), slo, 0.0)
    assert opt is not None and opt.instance.id == "d0" and opt.reason == LOCAL_REASON
    # Empty batch, empty local queue: TTFT is the prefill alone (no step to wait for).
    expected = c.instances["d0"].predictors.prefill.predict(64, 0)
    assert opt.ttft_s == pytest.approx(expected)
    assert opt.transfer_s == 0.0 and opt.cached_tokens == 0


def test_stays_disaggregated_when_the_prefill_pool_is_faster() -> None:
    c = conductor()
    req = request("r", prompt(1, 4))
    slo = resolve_slo(req, c.settings.slo)
    fast = c.instances["d0"].predictors.prefill.predict(64, 0) * 0.99
    assert local_prefill(req, c.instances["d0"], remote(c, fast), slo, 0.0) is None


def test_stays_disaggregated_when_the_mixed_step_would_break_the_batch_tbt() -> None:
    c = conductor()
    d0 = c.instances["d0"]
    req = request("r", prompt(1, 4))
    slo = resolve_slo(req, c.settings.slo)
    prefill_s = d0.predictors.prefill.predict(64, 0)
    fill(c, 32, 4000)  # 32 running sequences of 4000 tokens
    step_after = d0.tbt_now(1, 64)
    keep = 1.0 - slo.priority.headroom

    def limit(seconds: float) -> EffectiveSLO:  # the SLO whose TBT limit is `seconds`
        return replace(slo, tbt_s=seconds / keep)

    tight = limit(step_after + prefill_s * 0.9)  # the prefill does not fit in one step's room
    assert local_prefill(req, d0, remote(c, 10.0), tight, 0.0) is None
    roomy = limit(step_after + prefill_s * 1.1)
    opt = local_prefill(req, d0, remote(c, 10.0), roomy, 0.0)
    assert opt is not None
    # Running batch: wait for the step in progress, then the mixed step (prefill + step).
    assert opt.ttft_s == pytest.approx(2 * d0.tbt_now() + prefill_s)


def test_local_prefills_queue_behind_each_other_on_the_decode_instance() -> None:
    c = conductor()
    d0 = c.instances["d0"]
    busy(c, "d0", 0.5)  # a local prefill of 0.5 s already queued there
    req = request("r", prompt(1, 4))
    slo = resolve_slo(req, c.settings.slo)
    opt = local_prefill(req, d0, remote(c, 2.0), slo, 0.0)
    assert opt is not None
    assert opt.queue_s == pytest.approx(0.5)
    assert opt.ttft_s == pytest.approx(0.5 + d0.predictors.prefill.predict(64, 0))
    assert local_prefill(req, d0, remote(c, 0.4), slo, 0.0) is None


def test_conductor_prefills_on_the_decode_instance_only_when_switched_on() -> None:
    for on in (True, False):
        c = conductor(on)
        busy(c, "p0", 5.0)
        busy(c, "p1", 5.0)
        req = request("r", prompt(1, 4))
        d = c.schedule(req, 0.0)
        assert isinstance(d, Decision)
        if not on:
            assert d.prefill in ("p0", "p1") and d.reason != LOCAL_REASON
            continue
        assert (d.prefill, d.decode, d.reason) == ("d0", "d0", LOCAL_REASON)
        assert d.predicted_transfer_s == 0.0 and d.predicted_ttft_s < 5.0
        c.dispatched(d, req, 0.0)
        d0 = c.instances["d0"]
        assert "r" in d0.prefill_queue and "r" in d0.incoming
        c.first_token("r", 0.1)  # prefill done: it decodes where it was prefilled
        assert "r" in d0.running and not d0.prefill_queue
        c.finished("r", 1.0, output_tokens=8)
        assert d0.idle


def test_the_switch_is_validated_as_a_boolean() -> None:
    s = settings_from_dict({"routing": {"conditional_disagg": True}})
    assert s.routing.conditional_disagg is True
    assert settings_from_dict({}).routing.conditional_disagg is False
    with pytest.raises(ConfigError, match="conditional_disagg"):
        settings_from_dict({"routing": {"conditional_disagg": "yes"}})
