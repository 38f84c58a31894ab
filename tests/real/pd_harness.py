"""Real vLLM prefill + decode pairs (NixlConnector with UCX over TCP on loopback, or
ExampleConnector through a shared directory), ``kvgate serve`` in front of them, and the engine
counters the P/D tests read; used by tests/real/test_vllm_pd*.py and bench/real_vllm_pd.py.

Recipe: shared/engines/vllm-cpu/README.md ("Prefill/decode disaggregation").
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from tests.real.engines import EngineProcess, start_vllm, stop_engine

# Each engine also needs its own VLLM_NIXL_SIDE_CHANNEL_PORT (the decode reads KV through it).
NIXL_ENV = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_TLS": "tcp,sm,self",
    "UCX_NET_DEVICES": "lo",
}


def nixl_engine_args(role: str) -> list[str]:
    """``--kv-transfer-config`` for ``role`` kv_producer (prefill), kv_consumer or kv_both."""
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return ["--kv-transfer-config", json.dumps(config)]


def shared_storage_engine_args(role: str, directory: str) -> list[str]:
    """``--kv-transfer-config`` for vLLM's ExampleConnector (KV through a shared directory)."""
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": directory},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def start_pair(
    ports: Sequence[int],
    args: tuple[Sequence[str], Sequence[str]],
    envs: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {}),
    kv_events: tuple[str | None, str | None] = (None, None),
    timeout_s: float = 180,
) -> tuple[EngineProcess, EngineProcess]:
    """(prefill, decode) -- or any two -- with their own engine args, env and KV-events
    endpoint, started together (~40-60 s each on 2 cores); both or neither."""

    def start(i: int) -> EngineProcess:
        return start_vllm(
            ports[i],
            env=envs[i],
            extra_args=args[i],
            kv_events_endpoint=kv_events[i],
            timeout_s=timeout_s,
        )

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, 0), pool.submit(start, 1)]
        started: list[EngineProcess] = []
        errors: list[BaseException] = []
        for f in futures:
            try:
                started.append(f.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        for proc in started:
            stop_engine(proc)
        raise errors[0]
    return started[0], started[1]


def start_nixl_pair(
    ports: Sequence[int], side_channel_ports: Sequence[int]
) -> tuple[EngineProcess, EngineProcess]:
    """A NixlConnector prefill (kv_producer) + decode (kv_consumer) pair."""
    envs = tuple({**NIXL_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(p)} for p in side_channel_ports)
    args = (nixl_engine_args("kv_producer"), nixl_engine_args("kv_consumer"))
    return start_pair(ports, args, (envs[0], envs[1]))


def all_instances_eligible(gateway_url: str) -> bool:
    """kvgate's /health says every instance can take requests (its first checks are in)."""
    try:
        with urllib.request.urlopen(gateway_url + "/health", timeout=1) as r:
            states = json.loads(r.read()).get("instances", {})
    except (OSError, ValueError):
        return False
    return bool(states) and all(states.values())


def pd_gateway_config(port: int, prefill: str, decode: str, kv_connector: str) -> str:
    """kvgate in front of one prefill and one decode engine (admission off; health checks 10 s
    apart, so three 2 s timeouts of an engine starved of CPU do not eject the only decode)."""
    return f"""
[server]
host = "127.0.0.1"
port = {port}
health_interval_s = 10
# A NIXL read between these CPU engines can stall for the prefill's 30 s lease: a whole
# (non-streamed) answer then sends nothing for longer than the default 30 s floor.
silence_min_s = 90
[admission]
mode = "none"
[routing]
block_size = 32
[[pools]]
name = "prefill"
role = "prefill"
kv_connector = "{kv_connector}"
[[pools.instances]]
id = "p0"
url = "{prefill}"
[[pools]]
name = "decode"
role = "decode"
kv_connector = "{kv_connector}"
[[pools.instances]]
id = "d0"
url = "{decode}"
"""


class KvgateProcess:
    """``kvgate serve`` in a subprocess, ended by PID."""

    def __init__(self, tmp: Path, name: str, port: int, config: str) -> None:
        cfg = tmp / f"{name}.toml"
        cfg.write_text(config)
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tmp / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvgate exited with {self.proc.returncode} (log {log.name})")
            if all_instances_eligible(self.url):
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kvgate on {self.url}: not every instance healthy after 30 s")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def wait_for(ok: Any, timeout_s: float, what: str) -> float:
    """Seconds until ``ok()``; a probe that times out (an engine's /metrics late on a box
    starved of CPU) counts as "not yet", not as a failure."""
    start = time.monotonic()
    last: OSError | None = None
    while time.monotonic() - start < timeout_s:
        try:
            if ok():
                return time.monotonic() - start
        except OSError as exc:  # urllib's URLError and socket timeouts are OSErrors
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"{what}: not within {timeout_s:g} s (last probe error: {last!r})")


def leave_once_started(url: str, body: dict[str, Any], started: Any, timeout_s: float) -> None:
    """Sends a request and closes the connection (a client that left) as soon as
    ``started()`` says the engines have it (not after a fixed delay: on a busy box the gateway
    may not even have read the body by then, and a request whose client left before that is
    rightly never sent anywhere). An answer that comes back first (a rejection, say) fails
    with that answer, not a bare timeout."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + payload)
        sock.setblocking(False)

        def answered() -> bytes:
            try:
                return sock.recv(4096)
            except BlockingIOError:
                return b""

        def ready() -> bool:
            if started():
                return True
            early = answered()  # an answer implies a prefill, unless the request was refused
            assert not early or started(), f"answered, no prefill: {early[:300]!r}"
            return bool(early)

        wait_for(ready, timeout_s, "the prefill engine took the request")


def metrics(engine: EngineProcess) -> str:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def prompt_tokens_by_source(engine: EngineProcess) -> dict[str, float]:
    pattern = r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} (\S+)'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, metrics(engine), re.M)}


def completions_served(engine: EngineProcess) -> float:
    """POST /v1/completions requests the engine's HTTP server finished (any 2xx/4xx/5xx):
    the proof a leg reached it, whatever the engine did with it (an aborted stream too)."""
    pattern = r'^http_requests_total\{[^}]*handler="/v1/completions"[^}]*method="POST"[^}]*\} (\S+)'
    return sum(float(m[1]) for m in re.finditer(pattern, metrics(engine), re.M))


def requests_running(engine: EngineProcess) -> float:
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)", metrics(engine), re.M)
    return float(m[1]) if m else 0.0


def kv_usage(engine: EngineProcess) -> float:
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", metrics(engine), re.M)
    assert m, f"no vllm:kv_cache_usage_perc on {engine.url}"
    return float(m[1])


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def warm_nixl_handshake(gateway_url: str, tries: int = 4) -> int:
    """One P/D request through the gateway until it succeeds; returns the attempts it took.

    The first NIXL transfer between a pair makes the decode side handshake with the prefill
    side, with a fixed 5 s receive timeout in vLLM 0.32 (nixl/base_worker.py); on a busy 2-core
    box that can time out and the decode engine answers that request 500. vLLM handshakes again
    on the next transfer, so the tests start from a pair that has shaken hands.
    """
    body = {"model": "tiny", "prompt": salted("warm up the pair"), "max_tokens": 2}
    for attempt in range(1, tries + 1):
        try:
            # A NIXL read on this box has been seen to stall for the prefill's whole 30 s
            # lease (decode log: "Avg xfer time (ms)=29755"): give one attempt room for that.
            post_json(gateway_url + "/v1/completions", body, timeout_s=120)
            return attempt
        except (urllib.error.HTTPError, TimeoutError):
            time.sleep(2.0)
    raise AssertionError(f"no P/D request succeeded in {tries} tries through {gateway_url}")


def salted(text: str) -> str:
    return f"[{uuid.uuid4().hex}] {text}"


def openai_call(client: openai.OpenAI, endpoint: str, stream: bool, prompt: str) -> tuple[int, int]:
    """(answer tokens, prompt tokens), as the engine reported them, through the openai SDK.
    Tokens, not text: a whole answer of the random-weight model once read as "" in a CI run
    (its greedy tokens can be bytes the detokenizer holds back as an incomplete UTF-8
    character, or end of sequence first); the tests care that an answer came back."""
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    if endpoint == "chat":
        messages = [{"role": "user", "content": prompt}]
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=stream, **extra
        )
    else:
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=stream, **extra
        )
    if not stream:
        return out.usage.completion_tokens, out.usage.prompt_tokens
    chunks, answer_tokens, prompt_tokens = 0, 0, 0
    for chunk in out:
        chunks += bool(chunk.choices)
        if chunk.usage is not None:
            answer_tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    assert chunks > 0, "the stream carried no choices"
    return answer_tokens, prompt_tokens


def epp_pd_spec(prefill_url: str, decode_url: str, connector: str, workdir: Path) -> Any:
    """An EppStackSpec (gateway/epp/stack.py) for one real prefill + decode pair behind Envoy:
    the stack starts a `kvgate pd-sidecar` in front of the decode engine. Admission off, the
    engines' block size 32, health probes 10 s apart (busy CPU engines answer late)."""
    from dataclasses import replace

    from config.settings import (
        AdmissionMode,
        InstanceSettings,
        KVConnector,
        PDProtocol,
        Role,
        Settings,
    )
    from gateway.epp.stack import EppStackSpec

    style = KVConnector(connector)

    def inst(iid: str, url: str, role: Role) -> InstanceSettings:
        return InstanceSettings(iid, url, role, protocol=PDProtocol.VLLM, kv_connector=style)

    base = Settings()
    return EppStackSpec(
        instances=(inst("p0", prefill_url, Role.PREFILL), inst("d0", decode_url, Role.DECODE)),
        base=replace(base, admission=replace(base.admission, mode=AdmissionMode.NONE)),
        block_size=32,
        kv_events=False,
        health_interval_s=10.0,
        workdir=workdir,
    )
