"""Doomed warm-ups on a real Conductor: a request turned away because its prompt misses the
TTFT SLO even on an idle instance leaves a warm-up of that prompt on an idle prefill instance
(the one holding most of it), only while enough of the pool is idle; once dispatched it is
booked like a prefill, never decodes, tells the output-length predictor nothing, and the
requests that share its prefix count it as cached there."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config.admission_settings import BestEffortSettings, DoomedWarmupSettings
from config.settings import AdmissionMode, AdmissionSettings, PDProtocol, SLOSettings
from routing.conductor import Conductor
from routing.doomed_warmup import WARMUP_SUFFIX
from routing.types import Decision, Rejection, RejectReason
from tests.routing.fleet import busy, fleet_settings, hold, prompt, request

SLO = SLOSettings(ttft_s=0.01, tbt_s=0.1)  # 64 blocks of 16 tokens take longer than that
DOOMED = prompt(1, 64)


def conductor(
    mode: AdmissionMode = AdmissionMode.EARLY, prefill: int = 3, **warmup: object
) -> Conductor:
    adm = AdmissionSettings(
        mode=mode,
        best_effort=BestEffortSettings(enabled=False),  # else an idle fleet serves it late
        doomed_warmup=DoomedWarmupSettings(**warmup),  # type: ignore[arg-type]
    )
    return Conductor(replace(fleet_settings(prefill=prefill, slo=SLO), admission=adm))


def rejected(c: Conductor, rid: str = "r", blocks: tuple[int, ...] = DOOMED, **kw) -> Rejection:
    out = c.schedule(request(rid, blocks, **kw), 0.0)
    assert isinstance(out, Rejection) and out.reason is RejectReason.TTFT_SLO
    return out


@pytest.mark.parametrize("mode", [AdmissionMode.EARLY, AdmissionMode.PREDICTIVE])
def test_a_doomed_rejection_carries_a_warmup_on_the_idle_instance_holding_most(
    mode: AdmissionMode,
) -> None:
    c = conductor(mode)
    hold(c, "p2", DOOMED[:20])  # p2 holds the first 20 blocks: the least work
    rej = rejected(c)
    w = rej.warmup
    assert w is not None and w.warmup
    assert w.request_id == "r" + WARMUP_SUFFIX
    assert (w.prefill, w.decode) == ("p2", "p2") and w.cached_tokens == 20 * 16
    assert w.predicted_prefill_s == pytest.approx(
        c.instances["p2"].predictors.prefill.predict(44 * 16, 20 * 16)
    )
    # Retry-After: when the warm-up should be done, within the configured bounds.
    assert rej.retry_after_s == c.settings.admission.retry_after_min_s
    assert c.stats.warmups == 0  # nothing is booked until the caller dispatches it


def test_dispatched_it_is_booked_like_a_prefill_and_never_decodes() -> None:
    c = conductor()
    rej = rejected(c)
    assert rej.warmup is not None
    before = c.output_lengths.predict(None, 4096)
    warm = c.dispatched_warmup(rej, request("r", DOOMED), 0.0)
    assert warm is not None
    p = c.instances[rej.warmup.prefill]
    assert warm.request_id == rej.warmup.request_id and warm.max_tokens == 1
    assert p.queue_time(0.0) == pytest.approx(rej.warmup.predicted_prefill_s)
    assert all(not d.incoming for d in c.instances.values())  # no decode booked anywhere
    assert c.stats.warmups == 1
    # A follower sharing the prompt's prefix counts it as cached there.
    assert c.index.match(prompt(1, 70), 0.0).local_blocks.get(p.id) == 64
    c.first_token(warm.request_id, 0.5)
    c.finished(warm.request_id, 0.5, output_tokens=1)
    assert not c.requests and p.queue_time(0.5) == 0.0
    assert c.output_lengths.predict(None, 4096) == before  # its one token taught nothing


def test_a_request_in_flight_with_the_warmups_id_keeps_its_books() -> None:
    c = conductor(min_idle=1)
    other = request("r" + WARMUP_SUFFIX, prompt(3, 2))  # a client chose that id
    d = c.schedule(other, 0.0)
    assert isinstance(d, Decision)
    c.dispatched(d, other, 0.0)
    rej = rejected(c)
    assert rej.warmup is not None
    assert c.dispatched_warmup(rej, request("r", DOOMED), 0.0) is None
    assert c.requests["r" + WARMUP_SUFFIX].decision is d and c.stats.warmups == 0


def test_only_while_its_decode_would_have_room() -> None:
    """Checked at a TBT above ``max_decode_load`` of its limit: where decode binds, the longer
    contexts its prefix lets in would take the room of shorter ones."""
    c = conductor()
    tbt = c.instances["d0"].tbt_now(1, 64 * 16)  # what an idle decode instance is checked at
    limit = 0.1 * 0.9  # the TBT SLO less the default class's 10 % headroom
    for load, warmed in ((1.1 * tbt / limit, True), (0.9 * tbt / limit, False)):
        assert (rejected(conductor(max_decode_load=load)).warmup is not None) is warmed, load


def test_without_slo_admission_nothing_is_warmed() -> None:
    out = conductor(AdmissionMode.NONE).schedule(request("r", DOOMED), 0.0)
    assert isinstance(out, Decision)  # admitted: no TTFT rejection to leave a warm-up


def test_only_while_enough_of_the_prefill_pool_is_idle() -> None:
    c = conductor()  # min_idle 3 of 3
    busy(c, "p0", 5.0)
    assert rejected(c).warmup is None
    c2 = conductor(min_idle=2)
    busy(c2, "p0", 5.0)
    w = rejected(c2).warmup
    assert w is not None and w.prefill != "p0"  # never behind booked work


def test_a_pool_smaller_than_min_idle_needs_all_of_it_idle() -> None:
    c = conductor(prefill=1)
    assert rejected(c).warmup is not None
    busy(c, "p0", 5.0)
    assert rejected(c, "r2").warmup is None


def test_not_when_off_nor_for_a_clients_own_deadline() -> None:
    assert rejected(conductor(enabled=False)).warmup is None
    c = conductor()
    # It asked for a deadline (clamped to the operator's floor, 50 ms: a longer prompt).
    assert rejected(c, blocks=prompt(2, 400), slo_ttft_s=0.05).warmup is None
    assert rejected(c, blocks=prompt(2, 400)).warmup is not None  # the configured SLO


def test_a_request_that_is_admitted_leaves_none() -> None:
    c = Conductor(replace(fleet_settings(slo=SLOSettings(ttft_s=30.0, tbt_s=0.1))))
    assert isinstance(c.schedule(request("r", DOOMED), 0.0), Decision)


def test_not_on_an_sglang_prefill_server() -> None:
    c = conductor()
    settings = c.settings
    pools = tuple(
        replace(p, instances=tuple(replace(i, protocol=PDProtocol.SGLANG) for i in p.instances))
        for p in settings.pools
    )
    c = Conductor(replace(settings, pools=pools))
    assert rejected(c).warmup is None  # it would wait for a decode's bootstrap
