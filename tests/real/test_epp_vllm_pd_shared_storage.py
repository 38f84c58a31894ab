"""P/D behind a real Envoy with vLLM's ExampleConnector (KV through a shared directory):
`kvgate epp` picks the pair, the decode engine's `kvgate pd-sidecar --connector
shared_storage` sends the one-token prefill and then the request unchanged, and the decode
engine loads the prompt's KV from the store by its tokens (no kv_transfer_params)."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.epp.envoy_stack import envoy_stack, require_envoy
from tests.real.conftest import EngineInstall
from tests.real.engines import free_ports, stop_engine
from tests.real.pd_harness import (
    epp_pd_spec,
    openai_call,
    prompt_tokens_by_source,
    salted,
    shared_storage_engine_args,
    start_pair,
)
from tests.real.test_vllm_pd_shared_storage import BLOCK, TEXT

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def epp_shared(vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory):
    require_envoy()
    tmp = tmp_path_factory.mktemp("epp-pd-shared")
    store = str(tmp / "kv")
    p_port, d_port = free_ports(2, lo=18600, hi=18640)
    args = (
        shared_storage_engine_args("kv_producer", store),
        shared_storage_engine_args("kv_consumer", store),
    )
    prefill, decode = start_pair([p_port, d_port], args)
    try:
        spec = epp_pd_spec(prefill.url, decode.url, "shared_storage", tmp / "stack")
        with envoy_stack(spec) as ts:
            yield ts, decode
    finally:
        stop_engine(decode)
        stop_engine(prefill)


@pytest.mark.parametrize(("endpoint", "stream"), [("completions", False), ("chat", True)])
def test_through_envoy_the_decode_engine_loads_the_prompt_from_the_shared_store(
    epp_shared, endpoint: str, stream: bool
) -> None:
    ts, decode = epp_shared
    client = openai.OpenAI(base_url=ts.url + "/v1", api_key="unused", max_retries=0)
    before = prompt_tokens_by_source(decode)
    answer_tokens, prompt_tokens = openai_call(client, endpoint, stream, salted(TEXT))
    after = prompt_tokens_by_source(decode)
    assert answer_tokens > 0 and prompt_tokens > 400
    delta = {k: after[k] - before[k] for k in after}
    # ExampleConnector loads every full block before the prompt's last token; the decode
    # engine computes only the rest (under one block) itself.
    loaded = (prompt_tokens - 1) // BLOCK * BLOCK
    assert delta["external_kv_transfer"] == loaded, delta
    assert delta["local_compute"] == prompt_tokens - loaded, delta
    assert ts.wait_books_empty(30.0) == (0, 0)
