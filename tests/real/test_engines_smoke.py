"""The repo's engine scripts give a real vLLM and llama-server with the signals kvgate relies on."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from tokenizers import Tokenizer

from tests.real.conftest import EngineInstall, run_install
from tests.real.engines import (
    EngineProcess,
    EngineStartError,
    free_ports,
    start_llama_server,
    start_vllm,
    stop_engine,
)

pytestmark = pytest.mark.real_engine

# ~160 tokens with the tiny model's tokenizer: several full 32-token blocks.
LONG_SYSTEM = "You are a careful assistant for the kvgate gateway tests. " * 12


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def assert_group_gone(proc: EngineProcess) -> None:
    """stop_engine leaves nothing of the engine behind (vLLM's engine-core and workers included)."""
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


@pytest.fixture(scope="module")
def vllm_engine(
    vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    (port,) = free_ports(1)
    proc = start_vllm(port, kv_events_endpoint=f"ipc://{sock}")
    yield proc
    stop_engine(proc)
    assert_group_gone(proc)


@pytest.fixture(scope="module")
def llama_engine(llamacpp_install: EngineInstall) -> Iterator[EngineProcess]:
    (port,) = free_ports(1)
    proc = start_llama_server(port, slots=2, ctx=4096)
    yield proc
    stop_engine(proc)
    assert_group_gone(proc)


def test_vllm_completion(vllm_engine: EngineProcess) -> None:
    out = post_json(
        vllm_engine.url + "/v1/completions",
        {"model": vllm_engine.model, "prompt": "hello world", "max_tokens": 8},
    )
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert out["usage"]["completion_tokens"] >= 1
    # BOS from the tokenizer's post-processor + the prompt's own tokens
    assert out["usage"]["prompt_tokens"] >= 3


def test_vllm_chat_completion(vllm_engine: EngineProcess) -> None:
    out = post_json(
        vllm_engine.url + "/v1/chat/completions",
        {
            "model": vllm_engine.model,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hello world"},
            ],
            "max_tokens": 8,
        },
    )
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] >= 1


def test_vllm_metrics_names(vllm_engine: EngineProcess) -> None:
    text = get_text(vllm_engine.url + "/metrics")
    assert "vllm:kv_cache_usage_perc" in text
    assert "vllm:num_requests_waiting" in text


def _block_stored(payload: bytes) -> list[dict[str, Any]]:
    """BlockStored events of one frame's payload ([ts, [event, ...], dp_rank]), as maps."""
    _ts, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    stored = []
    for ev in events:
        if isinstance(ev, dict) and ev.get("type") == "BlockStored":
            stored.append(ev)
        elif isinstance(ev, list) and ev and ev[0] == "BlockStored":  # array-encoded tag first
            stored.append(
                {
                    "type": ev[0],
                    "block_hashes": ev[1],
                    "parent_block_hash": ev[2],
                    "token_ids": ev[3],
                    "block_size": ev[4],
                }
            )
    return stored


def test_vllm_kv_event_block_stored_over_ipc(vllm_engine: EngineProcess, model_dir: Path) -> None:
    assert vllm_engine.kv_events_endpoint is not None
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    stored: list[dict[str, Any]] = []
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(vllm_engine.kv_events_endpoint)  # vLLM binds ipc:// endpoints
        time.sleep(0.5)  # let the subscription reach the publisher before the first request
        deadline = time.monotonic() + 60
        attempt = 0
        # A SUB socket misses what was published before its subscription reached the publisher,
        # so send a fresh prompt until an event arrives (bounded in count and time).
        while not stored and attempt < 5 and time.monotonic() < deadline:
            attempt += 1
            system = f"{attempt} {LONG_SYSTEM}"
            messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
            post_json(
                vllm_engine.url + "/v1/chat/completions",
                {"model": vllm_engine.model, "messages": messages, "max_tokens": 2},
            )
            wait_until = time.monotonic() + 3
            while not stored and time.monotonic() < wait_until:
                if sub.poll(500):
                    topic, _seq, payload = sub.recv_multipart()
                    assert topic == b"kv"
                    stored += [e for e in _block_stored(payload) if e["parent_block_hash"] is None]
    finally:
        sub.close(linger=0)
        ctx.term()
    assert stored, "no BlockStored event arrived"
    event = stored[0]
    assert event["block_size"] == 32
    assert len(event["token_ids"]) == 32 * len(event["block_hashes"]) >= 32
    # The engine stores the chat-template-rendered prompt: BOS, then ChatML.
    rendered = (
        f"<s><|im_start|>system\n{system}<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert event["token_ids"] == expected[: len(event["token_ids"])]


@pytest.fixture(scope="module")
def model_dir(vllm_engine: EngineProcess) -> Path:
    assert vllm_engine.model_dir is not None
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (vllm_engine.model_dir / name).is_file(), name
    return vllm_engine.model_dir


def test_llama_chat_reports_cache_timings(llama_engine: EngineProcess) -> None:
    body = {
        "model": llama_engine.model,
        "messages": [
            {"role": "system", "content": LONG_SYSTEM},
            {"role": "user", "content": "hello world"},
        ],
        "max_tokens": 4,
    }
    first = post_json(llama_engine.url + "/v1/chat/completions", body)
    second = post_json(llama_engine.url + "/v1/chat/completions", body)
    assert first["usage"]["completion_tokens"] == 4  # the shaped logits never stop early
    assert "cache_n" in first["timings"]
    # the repeat reuses the prompt prefix the first request left in its slot
    assert second["timings"]["cache_n"] > 0


def test_llama_metrics_names(llama_engine: EngineProcess) -> None:
    text = get_text(llama_engine.url + "/metrics")
    assert "llamacpp:prompt_tokens_total" in text
    assert "llamacpp:requests_processing" in text


def test_start_failure_raises_with_log_tail(llamacpp_install: EngineInstall) -> None:
    (port,) = free_ports(1)
    with pytest.raises(EngineStartError, match="exited") as err:
        start_llama_server(port, extra_args=["--no-such-flag"], timeout_s=30)
    assert "no-such-flag" in str(err.value)  # llama-server's own complaint, from the log


def test_install_refused_by_registry_skips_loudly(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    script = tmp_path / "refused.sh"
    script.write_text(
        "echo 'kvgate-engines: REGISTRY REFUSED: pip install x: "
        "ERROR: No matching distribution found for x==1'\nexit 3\n"
    )
    with pytest.raises(pytest.skip.Exception, match=r"REAL-ENGINE TESTS SKIPPED.*x==1"):
        run_install(request, "fake", script)


def test_install_other_failure_is_an_error(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    script = tmp_path / "broken.sh"
    script.write_text("echo 'compiler exploded'\nexit 1\n")
    with pytest.raises(pytest.fail.Exception, match="compiler exploded"):
        run_install(request, "fake", script)
