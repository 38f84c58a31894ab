"""kvgate's vLLM P/D driver with kv_connector "shared_storage" in front of a real pair joined by
vLLM's ExampleConnector (KV through a shared directory): the decode engine finds the prompt's
KV by its tokens, with no kv_transfer_params from the gateway."""

from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest

from tests.real.conftest import EngineInstall
from tests.real.engines import EngineProcess, free_ports, stop_engine
from tests.real.pd_harness import (
    KvgateProcess,
    openai_call,
    pd_gateway_config,
    prompt_tokens_by_source,
    salted,
    shared_storage_engine_args,
    start_pair,
)

pytestmark = pytest.mark.real_engine

TEXT = "The quick brown fox jumps over the lazy dog near the river bank. " * 10
BLOCK = 32  # the engines' --block-size


@dataclass(frozen=True)
class SharedStack:
    prefill: EngineProcess
    decode: EngineProcess
    gateway: str


@pytest.fixture(scope="module")
def shared_stack(vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("pd-shared")
    store = str(tmp / "kv")
    p_port, d_port, gw_port = free_ports(3, lo=18430, hi=18450)
    args = (
        shared_storage_engine_args("kv_producer", store),
        shared_storage_engine_args("kv_consumer", store),
    )
    prefill, decode = start_pair([p_port, d_port], args)
    try:
        config = pd_gateway_config(gw_port, prefill.url, decode.url, "shared_storage")
        gateway = KvgateProcess(tmp, "kvgate", gw_port, config)
        try:
            yield SharedStack(prefill, decode, gateway.url)
        finally:
            gateway.stop()
    finally:
        stop_engine(decode)
        stop_engine(prefill)


@pytest.mark.parametrize(("endpoint", "stream"), [("completions", False), ("chat", True)])
def test_decode_engine_loads_the_prompt_from_the_shared_store(
    shared_stack: SharedStack, endpoint: str, stream: bool
) -> None:
    client = openai.OpenAI(base_url=shared_stack.gateway + "/v1", api_key="unused", max_retries=0)
    before = prompt_tokens_by_source(shared_stack.decode)
    answer_tokens, prompt_tokens = openai_call(client, endpoint, stream, salted(TEXT))
    after = prompt_tokens_by_source(shared_stack.decode)
    assert answer_tokens > 0 and prompt_tokens > 400
    delta = {k: after[k] - before[k] for k in after}
    # ExampleConnector loads every full block before the prompt's last token; the decode
    # engine computes only the rest (under one block) itself.
    loaded = (prompt_tokens - 1) // BLOCK * BLOCK
    assert delta["external_kv_transfer"] == loaded, delta
    assert delta["local_compute"] == prompt_tokens - loaded, delta
