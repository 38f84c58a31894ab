"""TTFTEstimator: the three branches of Mooncake Algorithm 1 (local, pull, store), each with
real predictors and the books' queue, and the rules that gate a pull."""

from __future__ import annotations

import pytest

from config.settings import PredictorSettings, Role
from predictors.bundle import build_instance_predictors
from routing.estimates import STORE_SOURCE, TTFTEstimator
from routing.instance_books import InstanceState
from routing.types import PrefixMatch, RequestInfo

BLOCK = 16
PROMPT = 4096  # tokens: 256 blocks


def inst(iid: str, order: int = 0, link_gbps: float = 100.0) -> InstanceState:
    preds = build_instance_predictors(
        PredictorSettings(link_bandwidth_gbps=link_gbps), "llama3-8b-h100-tp1"
    )
    return InstanceState(iid, Role.PREFILL, preds, 100_000, 64, bit_order=order)


def estimator(
    match: PrefixMatch,
    holders: dict[str, InstanceState],
    *,
    threshold: float = 1.5,
    min_transfer_blocks: int = 1,
    transfer_allowed: bool = True,
    prompt_tokens: int = PROMPT,
) -> TTFTEstimator:
    request = RequestInfo("r", prompt_tokens, tuple(range(prompt_tokens // BLOCK)), 32, 0.0)
    return TTFTEstimator(
        request,
        match,
        0.0,
        block_size=BLOCK,
        threshold=threshold,
        min_transfer_blocks=min_transfer_blocks,
        holders=holders,
        transfer_allowed=transfer_allowed,
    )


def match(local: dict[str, int], gpu: dict[str, int] | None = None, store: int = 0) -> PrefixMatch:
    best = max(local.values(), default=0)
    holders = tuple(i for i, n in local.items() if n == best and best > 0)
    return PrefixMatch(dict(gpu if gpu is not None else local), dict(local), store, best, holders)


def test_local_without_prefix_is_queue_plus_full_prefill() -> None:
    a = inst("a")
    a.enqueue_prefill("x", 0.25, 100, now=0.0, ready_s=0.0)
    opt = estimator(match({}), {"a": a}).best(a)
    full = a.predictors.prefill.predict(PROMPT, 0)
    assert opt.reason == "no_prefix" and opt.pull_source is None
    assert opt.queue_s == pytest.approx(0.25)
    assert opt.ttft_s == pytest.approx(0.25 + full) and opt.cached_tokens == 0


def test_a_full_hit_still_computes_the_last_token() -> None:
    a = inst("a")
    opt = estimator(match({"a": PROMPT // BLOCK}), {"a": a}).local(a)
    assert opt.reason == "local_prefix" and opt.cached_tokens == PROMPT - 1
    assert opt.prefill_s == pytest.approx(a.predictors.prefill.predict(1, PROMPT - 1))


def test_the_host_tier_part_of_a_local_prefix_is_loaded_first() -> None:
    a = inst("a")
    opt = estimator(match({"a": 100}, gpu={"a": 40}), {"a": a}).local(a)
    assert opt.load_s == pytest.approx(a.predictors.host_load.time(60 * BLOCK))
    assert opt.load_s > 0 and opt.ttft_s == pytest.approx(opt.load_s + opt.prefill_s)


def test_pull_from_the_holder_when_it_beats_recomputing() -> None:
    a, h = inst("a", 0), inst("h", 1)
    opt = estimator(match({"h": 200}), {"a": a, "h": h}).best(a)
    assert opt.pull_source == "h" and opt.reason == "pull_prefix"
    assert opt.cached_blocks == 200 and opt.pull_from_block == 0
    assert opt.transfer_s == pytest.approx(a.predictors.link.time(200 * BLOCK, 0.0))
    assert opt.ttft_s == pytest.approx(opt.transfer_s + opt.queue_s + opt.prefill_s)
    assert opt.ttft_s < estimator(match({"h": 200}), {"a": a, "h": h}).local(a).ttft_s


@pytest.mark.parametrize(
    ("local", "kwargs"),
    [
        (150, {}),  # 200 / 150 < 1.5: the paper's balancing threshold says stay
        (0, {"min_transfer_blocks": 201}),  # remote part too short to be worth a transfer
        (0, {"transfer_allowed": False}),  # a policy (or the planner) rules pulls out
    ],
)
def test_pull_is_gated(local: int, kwargs: dict[str, object]) -> None:
    a, h = inst("a", 0), inst("h", 1)
    blocks = {"h": 200} | ({"a": local} if local else {})
    opt = estimator(match(blocks), {"a": a, "h": h}, **kwargs).best(a)  # type: ignore[arg-type]
    assert opt.pull_source is None and opt.cached_blocks == local


def test_a_slow_link_never_makes_the_choice_worse_than_recomputing() -> None:
    a, h = inst("a", 0, link_gbps=1e-4), inst("h", 1)
    est = estimator(match({"h": 200}), {"a": a, "h": h})
    opt = est.best(a)
    assert opt.pull_source is None and opt.ttft_s == est.local(a).ttft_s


def test_the_source_is_the_least_busy_healthy_holder() -> None:
    a, h1, h2, h3 = inst("a", 0), inst("h1", 1), inst("h2", 2), inst("h3", 3)
    h1.enqueue_prefill("x", 5.0, 100, now=0.0, ready_s=0.0)
    h3.healthy = False
    est = estimator(match({"h1": 200, "h2": 200, "h3": 200}), {i.id: i for i in (a, h1, h2, h3)})
    assert est.best(a).pull_source == "h2"
    own = est.best(h2)  # a holder uses its own prefix: nothing to pull
    assert own.pull_source is None and own.cached_blocks == 200


def test_store_load_when_the_store_holds_more() -> None:
    a = inst("a")
    opt = estimator(match({"a": 10}, store=200), {"a": a}).best(a)
    assert opt.pull_source == STORE_SOURCE and opt.reason == "load_from_store"
    assert opt.pull_from_block == 10 and opt.cached_blocks == 200
    assert opt.load_s == pytest.approx(a.predictors.store_load.time(190 * BLOCK))


def test_min_prefill_is_a_lower_bound_of_every_option() -> None:
    a, h = inst("a", 0), inst("h", 1)
    est = estimator(match({"h": 120, "a": 30}, store=60), {"a": a, "h": h})
    assert est.min_prefill(a) <= est.best(a).prefill_s
    assert est.min_prefill(a) == pytest.approx(a.predictors.prefill.predict(PROMPT - 1920, 1920))
