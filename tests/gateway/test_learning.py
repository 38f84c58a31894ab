"""Online refits of the prefill predictor, and a measured profile reaching the Conductor."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.profile_file import write_profile_file
from config.loader import settings_from_dict
from gateway.learning import FIRST_FIT_POLL_S, DecisionRecord, Learner, refit_loop
from gateway.runtime import Gateway
from predictors.calibration import SweepSample, fit_profile
from predictors.prefill import AnalyticPrefill
from routing.conductor import Conductor
from routing.types import Decision


def true_ms(n: int, c: int) -> float:
    return 30.0 + 0.5 * n + 1e-4 * n * (c + n / 2)


def sweep() -> list[SweepSample]:
    return [
        SweepSample(new_tokens=n, cached_tokens=c, seconds=true_ms(n, c) / 1000)
        for n in (64, 256, 1024, 2048)
        for c in (0, 1024)
    ]


def settings(server: dict[str, object] | None = None, **predictors: object):
    return settings_from_dict(
        {
            "predictors": dict(predictors),
            "server": {"refit_interval_s": 0, "refit_min_new_samples": 5, **(server or {})},
            "pools": [
                {
                    "name": "p",
                    "role": "both",
                    "instances": [
                        {"id": "e0", "url": "http://127.0.0.1:18598"},
                        {"id": "e1", "url": "http://127.0.0.1:18597"},
                    ],
                }
            ],
        }
    )


def observe(learner: Learner, count: int, scale: float = 1.0) -> None:
    for i in range(count):
        n = 100 + 150 * i
        learner.observe_prefill(None, n, 0, scale * true_ms(n, 0) / 1000)


def test_no_refit_until_enough_new_observations() -> None:
    learner = Learner(Conductor(settings()), 100, 200, min_new_samples=5)
    observe(learner, 4)
    assert asyncio.run(learner.refit()) == 0
    assert learner.refits == 0


def test_few_observations_refit_the_analytic_form_on_every_instance() -> None:
    conductor = Conductor(settings())
    learner = Learner(conductor, 100, 200, min_new_samples=5)
    before = conductor.instances["e0"].predictors.prefill.predict(1000, 0)
    observe(learner, 8)
    assert asyncio.run(learner.refit()) == 1
    assert learner.refits == 1 and learner.last_refit_kind == "analytic"
    preds = {id(i.predictors) for i in conductor.instances.values()}
    assert len(preds) == 1  # one swap shared by the instances of the profile
    prefill = conductor.instances["e1"].predictors.prefill
    assert isinstance(prefill, AnalyticPrefill)
    assert prefill.predict(1000, 0) == pytest.approx(true_ms(1000, 0) / 1000, rel=0.02)
    assert prefill.predict(1000, 0) > 10 * before  # the H100 default was far too optimistic
    # Nothing new: no second refit.
    assert asyncio.run(learner.refit()) == 0
    observe(learner, 5)
    assert asyncio.run(learner.refit()) == 1 and learner.refits == 2


def test_refit_continues_from_the_measured_sweep() -> None:
    cal = fit_profile(sweep(), name="mine", model="tiny")
    learner = Learner(
        Conductor(settings()), 100, 200, min_new_samples=5, prior={None: cal.prefill_samples}
    )
    observe(learner, 5, scale=1.2)  # the engine got 20 % slower since the sweep
    data = learner.training_set(None)
    assert data is not None and len(data) == 8 + 5
    assert asyncio.run(learner.refit()) == 1
    assert learner.accuracy()["prior_samples"] == {"None": 8}


def test_a_refit_trains_on_the_newest_window_of_observations() -> None:
    cal = fit_profile(sweep(), name="mine", model="tiny")
    learner = Learner(
        Conductor(settings()),
        100,
        200,
        min_new_samples=5,
        window=6,
        prior={None: cal.prefill_samples},
    )
    observe(learner, 10)
    data = learner.training_set(None)
    assert data is not None and len(data) == 8 + 6  # the sweep + the newest 6
    assert data.new_tokens[8:].tolist() == [100 + 150 * i for i in range(4, 10)]
    assert learner.accuracy()["prefill_samples"] == {"None": 6}


def test_the_window_comes_from_config() -> None:
    gw = Gateway(settings({"refit_window": 123}))
    assert gw.learner.window == 123


def test_enough_samples_train_lightgbm() -> None:
    cal = fit_profile(sweep(), name="mine", model="tiny")
    learner = Learner(
        Conductor(settings()), 100, 20, min_new_samples=5, prior={None: cal.prefill_samples}
    )
    observe(learner, 12)
    assert asyncio.run(learner.refit()) == 1
    assert learner.last_refit_kind == "lightgbm"


def test_gateway_uses_the_measured_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    cal = fit_profile(sweep(), name="mine", model="tiny")
    write_profile_file(path, cal)
    gw = Gateway(settings(profile_file=str(path)))
    for inst in gw.conductor.instances.values():
        assert inst.predictors.profile.name == "mine"
        # T_prefill is the measured time: no per-step overhead on top of it.
        expected = cal.profile.prefill.gpu_ms(1000, 0) / 1000
        assert inst.predictors.prefill.predict(1000, 0) == pytest.approx(expected)
        assert inst.capacity_tokens == cal.profile.kv_capacity_tokens
    assert gw.learner.accuracy()["prior_samples"] == {"None": 8, "mine": 8}


def _decision(**over: object) -> Decision:
    """A decision as the Conductor makes one for a colocated request, fields overridden."""
    fields: dict[str, object] = {
        "request_id": "r1",
        "prefill": "e0",
        "decode": "e0",
        "predicted_ttft_s": 0.6,
        "predicted_tbt_s": 0.01,
        "predicted_queue_s": 0.5,
        "predicted_prefill_s": 0.1,
        "predicted_transfer_s": 0.0,
        "predicted_load_s": 0.0,
        "predicted_output_tokens": 16,
        "cached_tokens": 0,
        "prompt_tokens": 1000,
        "policy": "kvcache_centric",
        "reason": "no_prefix",
        "priority": "normal",
        "slo_ttft_s": 1.0,
        "slo_tbt_s": 0.1,
    }
    return Decision(**(fields | over))  # type: ignore[arg-type]


def test_answers_correct_a_colocated_instances_queue_waits() -> None:
    conductor = Conductor(settings())
    learner = Learner(conductor, 100, 200, queue_scale_rate=0.2)
    for i in range(40):  # every request waited 1.5x what the books said
        scale = conductor.instances["e0"].queue_scale
        d = _decision(request_id=f"r{i}", predicted_queue_s=0.5 * scale)
        rec = DecisionRecord.of(d.request_id, 0.0, d)
        assert (rec.predicted_queue_s, rec.predicted_prefill_s) == (0.5 * scale, 0.1)
        rec.observed_ttft_s = 0.75 + 0.1
        learner.observe_answer(d, rec, None)
    assert conductor.instances["e0"].queue_scale == pytest.approx(1.5, rel=0.01)
    assert conductor.instances["e1"].queue_scale == 1.0  # only the instance that answered
    assert learner.accuracy()["queue_scales"] == {"e0": {"scale": 1.5, "samples": 40}}


def test_disaggregated_answers_and_a_zero_rate_leave_the_books_alone() -> None:
    for learner_rate, decode in ((0.2, "e1"), (0.0, "e0")):
        conductor = Conductor(settings())
        learner = Learner(conductor, 100, 200, queue_scale_rate=learner_rate)
        d = _decision(decode=decode)
        rec = DecisionRecord.of(d.request_id, 0.0, d)
        rec.observed_ttft_s = 5.0
        learner.observe_answer(d, rec, None)
        assert conductor.instances["e0"].queue_scale == 1.0
        assert learner.accuracy()["queue_scales"] == {}


def test_the_first_refit_comes_once_there_are_samples_not_an_interval_later() -> None:
    learner = Learner(Conductor(settings()), 100, 200, min_new_samples=5)
    assert learner.first_fit_pending()  # nothing observed yet

    async def main() -> tuple[int, int]:
        stop = asyncio.Event()
        task = asyncio.create_task(refit_loop(learner, 60.0, stop))
        observe(learner, 5, scale=3.0)
        for _ in range(100):  # the first refit: after FIRST_FIT_POLL_S, not 60 s
            if learner.refits:
                break
            await asyncio.sleep(0.05)
        first = learner.refits
        observe(learner, 5, scale=3.0)  # enough for a second refit, due only in 60 s
        await asyncio.sleep(FIRST_FIT_POLL_S + 0.5)
        stop.set()
        await asyncio.wait_for(task, 1)
        return first, learner.refits

    first, later = asyncio.run(main())
    assert (first, later) == (1, 1) and not learner.first_fit_pending()


def test_a_first_token_after_an_adapters_load_from_disk_teaches_no_prefill_and_no_wait() -> None:
    conductor = Conductor(settings())
    learner = Learner(conductor, 100, 200, min_new_samples=1, queue_scale_rate=0.2)
    for over in ({"predicted_queue_s": 0.0}, {"predicted_queue_s": 0.5}):
        d = _decision(adapter_load_s=0.0, **over)  # cold: 7 s of it was the load
        rec = DecisionRecord.of(d.request_id, 0.0, d)
        rec.observed_ttft_s = 7.0
        learner.observe_answer(d, rec, None)
    assert learner.training_set(None) is None
    assert conductor.instances["e0"].queue_scale == 1.0
    d = _decision(predicted_queue_s=0.0)  # the same without the load: a prefill sample
    rec = DecisionRecord.of(d.request_id, 0.0, d)
    rec.observed_ttft_s = 0.2
    learner.observe_answer(d, rec, None)
    assert learner.training_set(None) is not None
    assert learner.accuracy()["lora_load"] == conductor.lora.loads.as_dict()
