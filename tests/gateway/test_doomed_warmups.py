"""gateway/doomed_warmups.py on real sockets: the client of a doomed request hears 429 at once,
the prefill engine gets its prompt as a plain one-token request, and the books close whether
the engine answered or failed (the next doomed request finds the instance idle again)."""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.doomed_warmups import warmup_body
from routing.doomed_warmup import WARMUP_SUFFIX
from tests.gateway.test_proxy import _tiny_slo_gateway

BODY = {"prompt": "hello " * 50, "max_tokens": 8, "stream": True}


def test_the_body_asks_for_one_token_plainly() -> None:
    body = {**BODY, "stream_options": {"include_usage": True}, "n": 3}
    out = warmup_body(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and out["n"] == 1
    assert "stream_options" not in out and out["prompt"] == BODY["prompt"]
    assert body["max_tokens"] == 8  # the client's body is not changed
    chat = warmup_body({"messages": [], "max_completion_tokens": 50}, slot=1)
    assert chat["max_completion_tokens"] == 1 and chat["id_slot"] == 1


async def _metric(s: aiohttp.ClientSession, url: str, line: str) -> str:
    for _ in range(100):  # the warm-up runs after the client's answer: wait for it, bounded
        async with s.get(url + "/metrics") as r:
            text = await r.text()
        if line in text:
            break
        await asyncio.sleep(0.02)
    return text


def _run(prefill_fails: int | None, requests: int):
    async def run():
        gateway = _tiny_slo_gateway(best_effort=False, warmup=True, prefill_fails=prefill_fails)
        answers = []
        async with gateway as (url, seen), aiohttp.ClientSession() as s:
            for i in range(requests):
                async with s.post(url + "/v1/completions", json=BODY) as r:
                    answers.append((r.status, dict(r.headers), await r.json()))
                outcome = "failed" if prefill_fails else "ok"
                metrics = await _metric(
                    s, url, f'kvgate_doomed_warmups_total{{outcome="{outcome}"}} {i + 1}.0'
                )
        return answers, metrics, seen

    return asyncio.run(run())


def test_a_doomed_request_is_refused_and_its_prompt_warmed() -> None:
    answers, metrics, seen = _run(prefill_fails=None, requests=1)
    ((status, headers, body),) = answers
    assert status == 429 and body["error"]["code"] == "ttft_slo"
    assert int(headers["Retry-After"]) >= 1
    assert 'kvgate_doomed_warmups_total{outcome="ok"} 1.0' in metrics
    ((path, engine_headers, sent),) = seen  # the prefill engine alone, once
    assert path == "/v1/completions"
    assert engine_headers["X-Request-Id"].endswith(WARMUP_SUFFIX)
    assert sent["prompt"] == BODY["prompt"] and sent["max_tokens"] == 1
    assert sent["stream"] is False and "kv_transfer_params" not in sent


def test_a_failed_warmup_closes_its_books() -> None:
    answers, metrics, seen = _run(prefill_fails=500, requests=2)
    assert [a[0] for a in answers] == [429, 429]  # the clients never see the warm-up's fate
    assert 'kvgate_doomed_warmups_total{outcome="failed"} 2.0' in metrics
    # The second doomed request found the instance idle again: its books were closed.
    assert len(seen) == 2
