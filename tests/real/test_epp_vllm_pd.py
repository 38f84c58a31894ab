"""P/D behind a real Envoy with real engines: `kvgate epp` picks the prefill and decode vLLM
of a NixlConnector pair (UCX over TCP on loopback), Envoy sends each request to the decode
engine's `kvgate pd-sidecar`, which runs the prefill leg there and the decode with the KV it
pulls. The openai SDK, completions and chat, streamed and not: the decode engine computes
none of the prompt (vllm:prompt_tokens_by_source_total), and the books close."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.epp.envoy_stack import envoy_stack, require_envoy
from tests.real.conftest import EngineInstall
from tests.real.engines import free_ports, stop_engine
from tests.real.pd_harness import (
    completions_served,
    epp_pd_spec,
    kv_usage,
    leave_once_started,
    openai_call,
    prompt_tokens_by_source,
    requests_running,
    salted,
    start_nixl_pair,
    wait_for,
    warm_nixl_handshake,
)
from tests.real.test_vllm_pd import LONG_TEXT, STALL_S, TEXT

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def epp_pd(vllm_install: EngineInstall, tmp_path_factory: pytest.TempPathFactory):
    require_envoy()
    p_port, d_port = free_ports(2, lo=18520, hi=18550)
    side = free_ports(2, lo=18550, hi=18600)
    prefill, decode = start_nixl_pair([p_port, d_port], side)
    try:
        spec = epp_pd_spec(prefill.url, decode.url, "nixl", tmp_path_factory.mktemp("epp-pd"))
        with envoy_stack(spec) as ts:
            warm_nixl_handshake(ts.url)
            yield ts, prefill, decode
    finally:
        stop_engine(decode)
        stop_engine(prefill)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_through_envoy_the_decode_engine_takes_every_prompt_token_from_the_transfer(
    epp_pd, endpoint: str, stream: bool
) -> None:
    ts, prefill, decode = epp_pd
    client = openai.OpenAI(base_url=ts.url + "/v1", api_key="unused", max_retries=0)
    p_before, d_before = prompt_tokens_by_source(prefill), prompt_tokens_by_source(decode)
    answer_tokens, prompt_tokens = openai_call(client, endpoint, stream, salted(TEXT))
    p_after, d_after = prompt_tokens_by_source(prefill), prompt_tokens_by_source(decode)
    assert answer_tokens > 0 and prompt_tokens > 400
    d_delta = {k: d_after[k] - d_before[k] for k in d_after}
    assert d_delta["external_kv_transfer"] == prompt_tokens, d_delta
    assert d_delta["local_compute"] == 0 and d_delta["local_cache_hit"] == 0, d_delta
    assert p_after["local_compute"] - p_before["local_compute"] == prompt_tokens
    assert ts.wait_books_empty(30.0) == (0, 0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_leaving_through_envoy_during_the_prefill_frees_the_prefill_blocks(
    epp_pd, stream: bool
) -> None:
    """The client goes once the prefill engine has the request; Envoy resets its stream to
    the sidecar, which lets the prefill finish and still delivers the decode leg (aborted),
    so the prefill engine's blocks held for a decode are freed — at the latest by vLLM's
    lease, as through `kvgate serve` (tests/real/test_vllm_pd.py)."""
    ts, prefill, decode = epp_pd
    gw = ts.gateway
    wait_for(lambda: kv_usage(prefill) == 0.0, STALL_S, "prefill engine idle")
    # A CPU engine busy with the previous case may have answered probes late: pick only once
    # the gateway counts both instances in again.
    wait_for(
        lambda: ts.call(lambda: all(i.eligible for i in gw.conductor.instances.values())),
        STALL_S,
        "both instances eligible",
    )
    before = prompt_tokens_by_source(prefill)["local_compute"]
    served = completions_served(decode)
    body = {"model": "tiny", "prompt": salted(LONG_TEXT), "max_tokens": 200, "stream": stream}
    leave_once_started(
        ts.url,
        body,
        lambda: (
            requests_running(prefill) > 0
            or prompt_tokens_by_source(prefill)["local_compute"] > before
        ),
        STALL_S,
    )
    wait_for(
        lambda: prompt_tokens_by_source(prefill)["local_compute"] > before,
        STALL_S,
        "prefill computed",
    )
    wait_for(lambda: completions_served(decode) > served, STALL_S, "the decode leg delivered")
    wait_for(lambda: kv_usage(prefill) == 0.0, STALL_S, "blocks freed")
    assert ts.wait_books_empty(30.0) == (0, 0)
