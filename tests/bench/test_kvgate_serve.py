"""bench.kvgate_serve.wait_healthy: a poll that reads garbage (a socket that connected to
itself before the gateway listened) is one more try, not a failed benchmark."""

from __future__ import annotations

import http.client
import subprocess
import sys
from contextlib import contextmanager

import pytest

from bench import kvgate_serve


class _Ok:
    status = 200


def test_a_garbled_health_answer_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    answers = [http.client.BadStatusLine("GET /health HTTP/1.1"), ConnectionRefusedError(), None]

    @contextmanager
    def urlopen(url: str, timeout: float):
        failure = answers.pop(0)
        if failure is not None:
            raise failure
        yield _Ok()

    monkeypatch.setattr(kvgate_serve.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(kvgate_serve.time, "sleep", lambda s: None)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        kvgate_serve.wait_healthy("http://127.0.0.1:1/health", proc, timeout_s=5.0)
    finally:
        proc.kill()
        proc.wait()
    assert answers == []
