"""``kvgate serve`` as a child process for benchmarks: started on a config, waited for until
``/health`` answers, ended by PID (SIGTERM, then SIGKILL) however the benchmark exits."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

KVGATE_MAIN = "import sys; from gateway.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], timeout_s: float, what: str = "kvgate serve"
) -> None:
    """Until ``url`` answers 200; ``what`` names ``proc`` if it exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            # HTTPException: e.g. a poll that, before the gateway listens, connected to itself
            # (its ephemeral source port was the port asked for) and read its request back
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@contextmanager
def kvgate_serve(config: Path, port: int, log: Path, timeout_s: float = 30.0) -> Iterator[str]:
    """Run ``kvgate serve --config config`` (which listens on ``port``); yields its base URL."""
    with log.open("wb") as out:
        argv = [sys.executable, "-c", KVGATE_MAIN, "serve", "--config", str(config)]
        proc = subprocess.Popen(
            [*argv, "--log-level", "warning"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(f"{url}/health", proc, timeout_s)
            yield url
        finally:
            stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s: a process this benchmark started, by its PID."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def end_children_on_sigterm() -> None:
    """SIGTERM ends a benchmark as Ctrl-C does: its ``finally`` blocks end the children it
    started, by PID."""
    signal.signal(signal.SIGTERM, _interrupt)
