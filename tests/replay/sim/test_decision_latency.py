"""`kvgate bench decision` end to end (small): it times real decisions, with the decode
reservation on (as served) or off."""

from __future__ import annotations

import json

import pytest

from gateway.cli import main
from replay.sim.decision_latency import build_settings, run


@pytest.mark.parametrize("reservation", [True, False])
def test_run_times_every_decision(reservation: bool) -> None:
    res = run(8, 16, requests=50, seed=1, reservation=reservation)
    assert res.admitted + res.rejected == 50
    assert 0 < res.p50_us <= res.p99_us <= res.max_us
    assert build_settings(8, reservation=reservation).admission.decode_reservation.enabled is (
        reservation
    )


def test_cli_json_and_bad_arguments(capsys) -> None:
    args = ["bench", "decision", "--instances", "4", "--prompt-blocks", "8", "--requests", "20"]
    assert main([*args, "--decode-reservation", "off", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 20 and out["instances"] == 4
    assert main(["bench", "decision", "--requests", "0"]) == 2
    assert "--requests must be >= 1" in capsys.readouterr().err
