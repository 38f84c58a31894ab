"""Real-engine fixtures: install the engines once per session through the repo's scripts.

An install that the package registry refuses skips the real-engine tests LOUDLY (the reason names
the package); any other install failure is an error, never a skip.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.real.engines import ENGINE_SCRIPTS, engine_cache_dir, free_ports

# free_ports is re-exported: importable from here or from tests.real.engines
__all__ = ["EngineInstall", "free_ports", "run_install"]

REGISTRY_REFUSED_EXIT = 3  # the scripts' exit code when pip/apt says no
REFUSED_MARK = "kvgate-engines: REGISTRY REFUSED:"


@dataclass(frozen=True)
class EngineInstall:
    kind: str
    cache_dir: Path
    seconds: float


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under tests/real/ is a real-engine test, even one that forgot its pytestmark."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.real_engine)


def run_install(request: pytest.FixtureRequest, kind: str, script: Path) -> EngineInstall:
    """Run `bash SCRIPT install` with live progress; skip loudly on a registry refusal (exit 3)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    # show progress live, past pytest's output capture (absent with -p no:capture)
    shown = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    started = time.monotonic()
    lines: list[str] = []
    with shown:
        print(f"\n[real engines] bash {script} install", flush=True)
        proc = subprocess.Popen(
            ["bash", str(script), "install"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:  # progress as it happens: a first install takes minutes
            lines.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()
        code = proc.wait()
    seconds = time.monotonic() - started
    refused = [ln for ln in lines if REFUSED_MARK in ln]
    if code == REGISTRY_REFUSED_EXIT and refused:
        pytest.skip(
            f"!!! REAL-ENGINE TESTS SKIPPED: the package registry refused a package for {kind}: "
            f"{refused[0].split(REFUSED_MARK, 1)[1].strip()}"
        )
    if code != 0:
        tail = "\n".join(lines[-30:])
        pytest.fail(f"{script} install failed with exit {code}:\n{tail}", pytrace=False)
    return EngineInstall(kind=kind, cache_dir=engine_cache_dir(), seconds=seconds)


@pytest.fixture(scope="session")
def vllm_install(request: pytest.FixtureRequest) -> Iterator[EngineInstall]:
    yield run_install(request, "vllm", ENGINE_SCRIPTS / "vllm_cpu.sh")


@pytest.fixture(scope="session")
def llamacpp_install(request: pytest.FixtureRequest) -> Iterator[EngineInstall]:
    yield run_install(request, "llamacpp", ENGINE_SCRIPTS / "llamacpp.sh")
