"""The command line stays light: help and the gateway's own commands import neither numpy nor
lightgbm (only the subcommand being run builds its arguments)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

PROBE = """
import sys
from gateway.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("HEAVY", sorted(m for m in ("numpy", "lightgbm") if m in sys.modules))
"""


def _run(*argv: str) -> tuple[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True
    ).stdout
    heavy = next(line for line in out.splitlines() if line.startswith("HEAVY"))
    return out, ast.literal_eval(heavy.split(" ", 1)[1])


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["config", "--help"]])
def test_help_imports_neither_numpy_nor_lightgbm(argv: list[str]) -> None:
    out, heavy = _run(*argv)
    assert heavy == []
    assert "usage: kvgate" in out


def test_a_subcommands_help_still_lists_its_options() -> None:
    out, _ = _run("serve", "--help")
    assert "--config" in out
    top, _ = _run("--help")
    for name in ("serve", "sim", "demo", "profile", "predictors"):
        assert name in top
