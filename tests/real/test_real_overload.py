"""Early admission against a real llama-server under overload (bench/real_overload.py, short).

The engine is calibrated by a short ``kvgate profile``; the same open-loop load then runs
through kvgate with admission off and with early admission: a few seconds at a rate the engine
serves, then at four times it. Admitting everything, the engine's queue grows and the
overload phase's requests wait seconds for their first token; early admission turns the excess
away at once and what it admits is served sooner, so more requests meet the TTFT SLO.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.real_overload import measure_profile, parse_args, run_mode
from tests.real.conftest import EngineInstall

pytestmark = pytest.mark.real_engine

RATE = 4.0  # requests/s one llama-server (-np 2 -t 1) serves within a 1 s TTFT SLO here


def test_early_admission_keeps_goodput_where_admitting_everything_collapses(
    llamacpp_install: EngineInstall, tmp_path: Path
) -> None:
    argv = ["--instances", "1", "--seconds", "8", "--factor", "4", "--profile-seconds", "40"]
    args = parse_args([*argv, "--rate-1x", str(RATE)])
    profile = measure_profile(args, tmp_path)
    none = run_mode(args, "none", RATE, tmp_path / "none", profile)
    early = run_mode(args, "early", RATE, tmp_path / "early", profile)
    for run in (none, early):
        assert run["gateway_tracebacks"] == 0
        assert run["books_end"]["requests_in_flight"] == 0, run["books_end"]
        assert run["phases"][1]["failed"] == 0, run["phases"][1]["failures_by_reason"]
    over_none, over_early = none["phases"][1], early["phases"][1]
    assert over_none["rejected"] == 0
    assert over_early["rejected"] > 0
    # turned away before any engine work, mostly on the TTFT SLO (a request whose decode would
    # sit through the overload's prefills may also fail the colocated TBT check)
    reasons = over_early["rejections_by_reason"]
    assert all(r.startswith("before_prefill:") for r in reasons), reasons
    assert reasons.get("before_prefill:ttft_slo", 0) > reasons.get("before_prefill:tbt_slo", 0)
    # what early admits is served sooner, and more requests meet the SLO
    assert over_early["ttft_p50_s"] < over_none["ttft_p50_s"]
    # (measured here: 10.5-10.6 against 1.6-1.75 requests/s)
    assert over_early["goodput_rps"] > 2 * over_none["goodput_rps"], (over_early, over_none)
