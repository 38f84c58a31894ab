"""Targets of the proxy benchmark: stub engines, kvgate, sglang-router and vllm-router.

Every process is started in its own session, remembered by PID and ended by PID (SIGTERM, then
SIGKILL after a grace period), children included. The Rust routers are installed with pip into
their own venvs outside the repository when missing. CPU time is read from /proc for a
process and all its descendants (every thread: utime + stime).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent
ROUTERS = {  # venv name -> (pip requirement, distribution name)
    "sglang": ("sglang-router==0.3.2", "sglang-router"),
    "vllmrouter": ("vllm-router==0.1.17", "vllm-router"),
}
# target name -> (venv, policy)
ROUTER_TARGETS = {
    "sglang-rr": ("sglang", "round_robin"),
    "sglang-ca": ("sglang", "cache_aware"),
    "vllm-rr": ("vllmrouter", "round_robin"),
    "vllm-ca": ("vllmrouter", "cache_aware"),
}
# kvgate as shipped (approximate prompt identity), and with the engine-exact tokenizer and chat
# template of a model directory (``routing.model_dir``, issue 10's prompt identity).
KVGATE_TARGETS = ("kvgate", "kvgate-exact")
ALL_TARGETS = (*KVGATE_TARGETS, *ROUTER_TARGETS)


def default_model_dir() -> Path | None:
    """The tiny HF model that engines/vllm_cpu.sh writes (tokenizer.json + chat template)."""
    cache = Path(os.environ.get("KVGATE_ENGINE_CACHE", Path.home() / ".cache/kvgate-engines"))
    path = cache / "vllm-0.32.0" / "tiny-model"
    return path if (path / "tokenizer.json").is_file() else None


# ---------------------------------------------------------------- /proc
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the given processes (all their threads)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    if stat[stat.rindex(b")") + 2 :].split()[0] == b"Z":  # a zombie is already gone
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / CLK_TCK  # everything but idle and iowait


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1])
        except OSError:
            continue
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------- processes
@dataclass
class Proc:
    name: str
    cmd: list[str]
    url: str
    log: Path
    popen: subprocess.Popen | None = None
    error: str | None = None
    pids: list[int] = field(default_factory=list)

    def start(self, env: dict[str, str] | None = None) -> None:
        with open(self.log, "wb") as log:
            self.popen = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **(env or {})},
                cwd=str(REPO),
            )

    def refresh_pids(self) -> list[int]:
        if self.popen is not None and self.popen.poll() is None:
            self.pids = tree(self.popen.pid)
        return self.pids

    def cpu(self) -> float:
        return cpu_seconds(self.refresh_pids())

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM to the process and its descendants (by PID), SIGKILL to whichever of them
        is still the same process (same start time) after the grace period."""
        if self.popen is None:
            return
        procs = [(pid, _start_time(pid)) for pid in tree(self.popen.pid)] if self.alive() else []
        for pid, _ in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        for pid, started in procs:
            if started is not None and _start_time(pid) == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        self.popen = None

    def log_tail(self, n: int = 600) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def post_ok(url: str, timeout_s: float = 2.0) -> bool:
    body = json.dumps(
        {
            "model": "stub-model",
            "messages": [{"role": "user", "content": "ready?"}],
            "max_tokens": 2,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200 and b"choices" in r.read()
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(proc: Proc, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            proc.error = f"exited with {proc.popen.returncode if proc.popen else '?'}: " + (
                proc.log_tail()
            )
            return False
        if post_ok(proc.url):
            return True
        time.sleep(0.25)
    proc.error = f"not ready after {timeout_s:.0f} s: " + proc.log_tail()
    return False


# ---------------------------------------------------------------- router venvs
def venv_python(workdir: Path, venv: str) -> Path:
    return workdir / f"venv-{venv}" / "bin" / "python"


def installed_version(python: Path, dist: str) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    r = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else None


def ensure_router(workdir: Path, venv: str, install: bool = True) -> tuple[str | None, str | None]:
    """(version, error): the router's venv under workdir, installed with pip if missing."""
    requirement, dist = ROUTERS[venv]
    python = venv_python(workdir, venv)
    version = installed_version(python, dist)
    if version or not install:
        return version, None if version else "not installed (--no-install)"
    log = workdir / f"pip-{venv}.log"
    try:
        with open(log, "wb") as out:
            subprocess.run(
                [sys.executable, "-m", "venv", str(python.parent.parent)],
                check=True,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
            subprocess.run(
                [str(python), "-m", "pip", "install", "-q", requirement],
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=600,
            )
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"venv/pip failed: {exc}"
    version = installed_version(python, dist)
    if version is None:
        return None, "pip install failed: " + log.read_text(errors="replace")[-400:]
    return version, None


# ---------------------------------------------------------------- commands
def stub_proc(workdir: Path, port: int, delay_ms: float) -> Proc:
    cmd = [sys.executable, "-m", "bench.stub_engine", "--port", str(port)]
    cmd += ["--delay-ms", str(delay_ms)]
    return Proc(f"stub{port}", cmd, f"http://127.0.0.1:{port}", workdir / f"stub-{port}.log")


def kvgate_config(stub_urls: list[str], port: int, model_dir: Path | None = None) -> str:
    lines = [
        "# generated by bench/proxy.py: colocated pool of stub engines",
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "health_interval_s = 2.0",
        "scrape_interval_s = 1.0",
        "",
        "[routing]",
        'policy = "kvcache_centric"',
        "block_size = 16",
        *([f'model_dir = "{model_dir}"'] if model_dir else []),
        "",
        "[admission]",
        'mode = "predictive"',
        "",
        "[replication]",
        "enabled = false",
        "",
        "[[pools]]",
        'name = "workers"',
        'role = "both"',
    ]
    for i, url in enumerate(stub_urls):
        lines += ["", "[[pools.instances]]", f'id = "w{i}"', f'url = "{url}"', 'protocol = "vllm"']
    return "\n".join(lines) + "\n"


def kvgate_proc(
    workdir: Path,
    stub_urls: list[str],
    port: int,
    name: str = "kvgate",
    model_dir: Path | None = None,
) -> Proc:
    config = workdir / f"{name}-bench.toml"
    config.write_text(kvgate_config(stub_urls, port, model_dir))
    kvgate = Path(sys.executable).parent / "kvgate"
    cmd = [str(kvgate), "serve", "--config", str(config), "--log-level", "warning"]
    return Proc(name, cmd, f"http://127.0.0.1:{port}", workdir / f"{name}.log")


def router_proc(workdir: Path, name: str, stub_urls: list[str], port: int) -> Proc:
    venv, policy = ROUTER_TARGETS[name]
    python = str(venv_python(workdir, venv))
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *stub_urls]
    common += ["--policy", policy, "--prometheus-host", "127.0.0.1"]
    common += ["--prometheus-port", str(port + 1000)]
    if venv == "sglang":
        cmd = [python, "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    else:
        cmd = [python, "-m", "vllm_router.launch_router", *common, "--log-level", "warning"]
    return Proc(name, cmd, f"http://127.0.0.1:{port}", workdir / f"{name}.log")
