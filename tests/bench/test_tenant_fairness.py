"""Smoke run of the tenant-fairness benchmark on a tiny emulated fleet (seconds, not minutes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.emulated_fleet import FleetSpec
from bench.tenant_fairness import TenantFleet, parse_args, run_config

# Below the kernel's ephemeral range (32768-60999 here): a health poll on a port in that range
# before anything listens can connect to itself and read its own request back.
BASE_PORT = 18940
TINY = ["--input-tokens", "256", "--output-tokens", "4", "--rate-1x", "4", "--gap-s", "0"]


def test_parse_args_checks_ranges() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--headroom", "1.0"])
    with pytest.raises(SystemExit):
        parse_args(["--burst", "0"])


def test_tenant_fairness_smoke(tmp_path: Path) -> None:
    args = parse_args([*TINY, "--seconds", "3", "--profile", "llama3-8b-h100-tp1"])
    spec = FleetSpec(workdir=tmp_path, base_port=BASE_PORT, profile=args.profile)
    with TenantFleet(spec, fair_share=True, headroom=0.3) as fleet:
        config = (tmp_path / "gateway.toml").read_text()
        assert "[tenants]" in config and "sk-bench" not in config  # only hashes
        rep = asyncio.run(run_config(fleet, args))
    alone, burst, a = rep["b_alone"], rep["b_with_a_burst"], rep["a_burst"]
    assert alone["requests"] > 0 and burst["requests"] > 0
    assert a["requests"] > burst["requests"]  # a bursts at 5x its share
    assert alone["failed"] == 0 and burst["failed"] == 0 and a["failed"] == 0
    # Every request got past the key check: nothing answered 401 (that would be "failed").
    assert alone["completed"] + alone["rejected"] == alone["requests"]
    drop = 100 * ((alone["slo_attainment"] or 0) - (burst["slo_attainment"] or 0))
    assert rep["b_attainment_drop_points"] == pytest.approx(drop, abs=0.01)
    assert rep["books_end"]["requests_in_flight"] == 0
    assert rep["gateway_tracebacks"] == 0
    assert len(rep["load_1m"]) == 4
