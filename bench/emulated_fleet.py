"""An emulated fleet for long live benchmarks: ``kvgate emulate`` engines and one ``kvgate serve``,
each a child process on 127.0.0.1 with ports from a given base, the admin API on (a bearer token
in the generated config). While it runs, the gateway's resident memory (``/proc/<pid>/status``
VmRSS) and its books (``/admin/state``, ``/admin/decisions``) can be read. Every child is ended
by its PID (SIGTERM, then SIGKILL) however the benchmark exits, Ctrl-C included.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kvgate_serve import KVGATE_MAIN, wait_healthy


@dataclass(frozen=True, slots=True)
class FleetSpec:
    workdir: Path  # config and child logs go here
    base_port: int = 18500  # gateway on base_port, engines on base_port + 1, + 2, ...
    prefill: int = 1
    decode: int = 1
    profile: str = "llama3-8b-h100-tp1"
    time_scale: float = 1.0  # the emulators' wall seconds per model second
    policy: str = "kvcache_centric"
    admission: str = "early"
    ttft_slo_s: float = 1.0
    tbt_slo_s: float = 0.1
    recent_decisions: int = 1000  # the decision history's bound (server.recent_decisions)
    # 0: no refits (the overload runs: they measure the gateway, not LightGBM); the soak runs
    # the gateway's default (60 s), whose memory is what it measures.
    refit_interval_s: float = 0.0
    refit_window: int | None = None  # server.refit_window; None: the gateway's default
    start_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Books:
    """The gateway's own accounting at one moment (admin API)."""

    requests_in_flight: int
    kv_index_blocks: int  # blocks in the gateway's KV index (all instances)
    decisions_total: int  # decisions made since start
    rejections_total: int
    decision_history: int  # records kept for /admin/decisions (bounded by recent_decisions)
    history_in_flight: int  # kept records still marked in_flight
    learner_samples: int  # the fullest learner window (observations kept for refits)
    learner_window: int  # its bound (server.refit_window)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def rss_kb(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    # One SIGTERM only: a second one makes `kvgate serve` skip its drain.
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class EmulatedFleet:
    """``with EmulatedFleet(spec) as fleet:`` starts everything, ``fleet.url`` is the gateway."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{spec.base_port}"
        self.engines: dict[str, subprocess.Popen[bytes]] = {}
        self.engine_urls: dict[str, str] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self._logs: list[Any] = []

    # ---------------------------------------------------------------- lifecycle
    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.spec.workdir / f"{name}.log").open("wb")
        self._logs.append(log)
        return subprocess.Popen(
            [sys.executable, "-c", KVGATE_MAIN, *args], stdout=log, stderr=subprocess.STDOUT
        )

    def _engine_ids(self) -> list[tuple[str, str]]:
        s = self.spec
        return [(f"p{i}", "prefill") for i in range(s.prefill)] + [
            (f"d{i}", "decode") for i in range(s.decode)
        ]

    def start(self) -> None:
        s = self.spec
        s.workdir.mkdir(parents=True, exist_ok=True)
        self.engine_urls = self._start_engines()
        config = s.workdir / "gateway.toml"
        config.write_text(self._config(self.engine_urls))
        self.gateway = self._spawn(
            "gateway", "serve", "--config", str(config), "--log-level", "warning"
        )
        wait_healthy(f"{self.url}/health", self.gateway, s.start_timeout_s)

    def _start_engines(self) -> dict[str, str]:
        """Start the engines, wait until they answer; their base URLs by instance id."""
        s = self.spec
        urls: dict[str, str] = {}
        for k, (iid, role) in enumerate(self._engine_ids(), start=1):
            port = s.base_port + k
            self.engines[iid] = self._spawn(
                iid,
                "emulate",
                "--role",
                role,
                "--profile",
                s.profile,
                "--port",
                str(port),
                "--time-scale",
                str(s.time_scale),
            )
            urls[iid] = f"http://127.0.0.1:{port}"
        for iid, url in urls.items():
            wait_healthy(f"{url}/health", self.engines[iid], s.start_timeout_s)
        return urls

    def _config(self, urls: dict[str, str]) -> str:
        s = self.spec
        lines = [
            "[slo]",
            f"ttft_s = {s.ttft_slo_s}",
            f"tbt_s = {s.tbt_slo_s}",
            "[routing]",
            f'policy = "{s.policy}"',
            "block_size = 16",
            "[admission]",
            f'mode = "{s.admission}"',
            "[predictors]",
            f'profile = "{s.profile}"',
            "[server]",
            'host = "127.0.0.1"',
            f"port = {s.base_port}",
            f'admin_token = "{self.token}"',
            f"recent_decisions = {s.recent_decisions}",
            f"refit_interval_s = {s.refit_interval_s}",
        ]
        if s.refit_window is not None:
            lines.append(f"refit_window = {s.refit_window}")
        for role in ("prefill", "decode"):
            lines += ["[[pools]]", f'name = "{role}"', f'role = "{role}"']
            for iid, url in urls.items():
                if iid.startswith(role[0]):
                    lines += ["[[pools.instances]]", f'id = "{iid}"', f'url = "{url}"']
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        procs = ([self.gateway] if self.gateway else []) + list(self.engines.values())
        for proc in procs:  # SIGTERM all first so they drain in parallel
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            _wait_or_kill(proc)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> EmulatedFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- observation
    @property
    def gateway_pid(self) -> int:
        assert self.gateway is not None, "fleet not started"
        return self.gateway.pid

    def gateway_rss_kb(self) -> int | None:
        return rss_kb(self.gateway_pid)

    def gateway_cpu_s(self) -> float | None:
        return cpu_s(self.gateway_pid)

    def admin(self, path: str, timeout_s: float = 5.0) -> Any:
        """GET an admin API path (with the fleet's token) as JSON. Blocking."""
        req = urllib.request.Request(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def books(self) -> Books:
        """Blocking (call it from a thread inside an event loop)."""
        state = self.admin("/admin/state")
        history = self.admin(f"/admin/decisions?limit={10 * self.spec.recent_decisions}")
        learner = self.admin("/admin/predictors")
        return Books(
            requests_in_flight=int(state["requests_in_flight"]),
            kv_index_blocks=int(state["cache_view_blocks"]),
            decisions_total=int(state["decisions"]),
            rejections_total=sum(int(v) for v in dict(state["rejections"]).values()),
            decision_history=len(history),
            history_in_flight=sum(1 for r in history if r.get("outcome") == "in_flight"),
            learner_samples=max(map(int, dict(learner["prefill_samples"]).values()), default=0),
            learner_window=int(learner["refit_window"]),
        )

    def settled_books(self, timeout_s: float = 15.0) -> Books:
        """The books once nothing is in flight any more (or as they are after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        books = self.books()
        while time.monotonic() < deadline and (books.requests_in_flight or books.history_in_flight):
            time.sleep(0.5)
            books = self.books()
        return books

    def log_tracebacks(self) -> int:
        """Tracebacks the gateway wrote to its log so far."""
        path = self.spec.workdir / "gateway.log"
        return path.read_text(errors="replace").count("Traceback") if path.exists() else 0
