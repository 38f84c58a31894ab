"""`kvgate demo` end to end on a short slice: the README's first command must keep working
(it broke once when the replication log became typed and nothing ran the demo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_a_short_slice_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--duration", "20", "--quiet"]
    proc = subprocess.run(
        [*cmd, "--time-scale", "0.05", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report  # the demo's summary: requests, goodput, replication
    text = json.dumps(report)
    assert "replication_issued" in text and "replication_confirmed" in text
