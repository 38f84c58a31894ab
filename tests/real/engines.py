"""Start and stop real inference engines (vLLM, llama.cpp's llama-server) on 127.0.0.1 for tests.

The engines come from the repo's own scripts (engines/vllm_cpu.sh, engines/llamacpp.sh), cached
outside the repo; run their `install` first (the `vllm_install` / `llamacpp_install` fixtures do).
Each engine's output goes to a temporary log file whose tail is raised with any start-up failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE_SCRIPTS = REPO_ROOT / "engines"
VLLM_VERSION = "0.32.0"
SERVED_MODEL = "tiny"

# What engines/vllm_cpu.sh serve sets too; repeated here so a caller's `env` can override it.
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message ends with its log tail."""


@dataclass(frozen=True)
class EngineProcess:
    kind: str  # "vllm" | "llamacpp"
    url: str  # http://127.0.0.1:PORT
    pid: int
    model: str  # served model name
    model_dir: Path | None  # HF model dir (tokenizer.json, tokenizer_config.json, ...) for vLLM
    kv_events_endpoint: str | None
    log_path: Path


def engine_cache_dir() -> Path:
    default = Path.home() / ".cache" / "kvgate-engines"
    return Path(os.environ.get("KVGATE_ENGINE_CACHE", default))


def vllm_model_dir() -> Path:
    return engine_cache_dir() / f"vllm-{VLLM_VERSION}" / "tiny-model"


def vllm_python() -> Path:
    """The vLLM venv's python (torch, transformers, safetensors): for the engines' own scripts."""
    return engine_cache_dir() / f"vllm-{VLLM_VERSION}" / "venv" / "bin" / "python"


def free_ports(count: int, lo: int = 18000, hi: int = 18100) -> list[int]:
    """`count` ports in [lo, hi) that 127.0.0.1 can bind right now (racy, but fine on loopback)."""
    found: list[int] = []
    for port in range(lo, hi):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"only {len(found)} of {count} free ports in [{lo}, {hi})")


def start_vllm(
    port: int,
    *,
    kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    block_size: int = 32,
    timeout_s: float = 180,
) -> EngineProcess:
    if block_size % 32:
        raise ValueError(f"block_size {block_size}: vLLM's CPU attention needs a multiple of 32")
    args = ["--block-size", str(block_size)]
    if kv_events_endpoint is not None:
        kv_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": kv_events_endpoint,
            "topic": "kv",
        }
        if kv_events_replay_endpoint is not None:
            kv_config["replay_endpoint"] = kv_events_replay_endpoint
        args += ["--kv-events-config", json.dumps(kv_config)]
    return _start(
        kind="vllm",
        command=[*_serve_command("vllm_cpu.sh", port), *args, *extra_args],
        port=port,
        env={**VLLM_ENV, **(env or {})},
        model_dir=vllm_model_dir(),
        kv_events_endpoint=kv_events_endpoint,
        timeout_s=timeout_s,
    )


def start_llama_server(
    port: int,
    *,
    slots: int = 2,
    ctx: int = 8192,
    cache_ram_mib: int = 0,
    extra_args: Sequence[str] = (),
    timeout_s: float = 60,
) -> EngineProcess:
    args = ["-np", str(slots), "-c", str(ctx), "--cache-ram", str(cache_ram_mib)]
    return _start(
        kind="llamacpp",
        command=[*_serve_command("llamacpp.sh", port), *args, *extra_args],
        port=port,
        env={},
        model_dir=None,
        kv_events_endpoint=None,
        timeout_s=timeout_s,
    )


def stop_engine(proc: EngineProcess, grace_s: float = 20.0) -> None:
    """SIGTERM the engine by PID; SIGKILL its process group (vLLM's workers too) after grace_s."""
    with contextlib.suppress(ProcessLookupError):  # gone already: still sweep its group
        os.kill(proc.pid, signal.SIGTERM)
    _wait_exit(proc.pid, grace_s)
    _kill_group(proc.pid)  # the engine if it ignored SIGTERM, and workers that outlived it
    _wait_exit(proc.pid, 5.0)
    _wait_group_gone(proc.pid, 5.0)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def _serve_command(script: str, port: int) -> list[str]:
    # the scripts exec the engine, so the PID we get is the engine's own
    return ["bash", str(ENGINE_SCRIPTS / script), "serve", str(port)]


def _start(
    *,
    kind: str,
    command: list[str],
    port: int,
    env: Mapping[str, str],
    model_dir: Path | None,
    kv_events_endpoint: str | None,
    timeout_s: float,
) -> EngineProcess:
    fd, log_name = tempfile.mkstemp(prefix=f"kvgate-{kind}-{port}-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log:
        # A new session makes the engine's PID its process group id, so stop_engine can end
        # vLLM's engine-core and worker children with it.
        popen = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    proc = EngineProcess(
        kind=kind,
        url=f"http://127.0.0.1:{port}",
        pid=popen.pid,
        model=SERVED_MODEL,
        model_dir=model_dir,
        kv_events_endpoint=kv_events_endpoint,
        log_path=log_path,
    )
    started = time.monotonic()
    try:
        _wait_healthy(proc, popen, timeout_s)
    except BaseException:
        stop_engine(proc)
        raise
    print(f"{kind} up on {proc.url} in {time.monotonic() - started:.1f} s (log {log_path})")
    return proc


def _wait_healthy(proc: EngineProcess, popen: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = popen.poll()
        if code is not None:
            raise EngineStartError(
                f"{proc.kind} on {proc.url} exited with {code} during start-up; "
                f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
            )
        if _ok(proc.url + "/health") and _ok(proc.url + "/v1/models"):
            return
        time.sleep(0.5)
    raise EngineStartError(
        f"{proc.kind} on {proc.url} not healthy after {timeout_s:.0f} s; "
        f"log {proc.log_path}:\n{log_tail(proc.log_path)}"
    )


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Reap `pid` if it is our child; True once it has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return True
        except ChildProcessError:  # not our child (or already reaped): poll for existence
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.1)
    return False


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def wait_until(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    """Polls ``cond`` every 50 ms; False if it did not hold within ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True
