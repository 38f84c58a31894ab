"""The P/D sidecar (gateway/epp/pd_sidecar.py) in front of recording stub engines: what each
leg receives, what the client gets back, and the failure paths (a prefill that fails, bad
input, a client that leaves during the prefill). Real sidecar under uvicorn, real HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from config.settings import KVConnector
from gateway.epp.pd_sidecar import FALLBACK_HEADER, PREFILLER_HEADER, PdSidecar
from gateway.epp.sidecar_cli import start_sidecar
from tests.backends.pd_stub import KV_PARAMS, SSE, StubEngine
from tests.backends.test_http1 import RawServer

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 8, "stream": True}


async def _post(url: str, body: Any, headers: dict[str, str] | None = None):
    async with aiohttp.ClientSession() as s:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with s.post(url + "/v1/completions", data=data, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.read()


def _with_stubs(test, connector: KVConnector = KVConnector.NIXL):
    async def run():
        p, d = StubEngine("prefill"), StubEngine("decode")
        p.partner = d
        purl, durl = await p.start(), await d.start()
        sidecar = await start_sidecar(PdSidecar(durl, connector))
        try:
            return await test(sidecar.url, purl.removeprefix("http://"), p, d)
        finally:
            await sidecar.stop()
            await p.server.close()
            await d.server.close()

    return asyncio.run(run())


def test_nixl_prefill_then_decode_with_the_params_the_prefill_returned() -> None:
    async def test(url, prefiller, p, d):
        hdrs = {PREFILLER_HEADER: prefiller, "x-request-id": "rid-7", "traceparent": "00-ab-cd-01"}
        status, headers, body = await _post(url, BODY, hdrs)
        assert status == 200 and body == SSE
        assert headers["Content-Type"].startswith("text/event-stream")
        assert FALLBACK_HEADER.decode() not in headers
        [(_, p_headers, p_body)] = p.seen
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert p_body["kv_transfer_params"]["do_remote_decode"] is True
        [(_, d_headers, d_body)] = d.seen
        assert d_body["kv_transfer_params"] == KV_PARAMS and d_body["max_tokens"] == 8
        for h in (p_headers, d_headers):  # the same id and trace on both legs
            assert h["X-Request-Id"] == "rid-7" and h["traceparent"] == "00-ab-cd-01"

    _with_stubs(test)


def test_shared_storage_sends_the_decode_unchanged() -> None:
    async def test(url, prefiller, p, d):
        status, _, body = await _post(url, BODY, {PREFILLER_HEADER: prefiller})
        assert status == 200 and body == SSE
        assert "kv_transfer_params" not in p.seen[0][2] and p.seen[0][2]["max_tokens"] == 1
        assert d.seen[0][2] == BODY

    _with_stubs(test, KVConnector.SHARED_STORAGE)


def test_without_a_prefiller_the_decode_engine_does_it_all() -> None:
    async def test(url, prefiller, p, d):
        status, _, body = await _post(url, BODY)
        assert status == 200 and body == SSE
        assert p.seen == [] and d.seen[0][2] == BODY

    _with_stubs(test)


def test_a_keep_alive_connection_the_engine_closed_while_idle_is_retried() -> None:
    # uvicorn (vLLM) closes a keep-alive connection after 5 s idle; a request sent on it just
    # then is reset (CI: "decode: connect failed: ClientOSError(104)"). The engine here reads
    # a connection's second request and closes it unanswered: the sidecar sends it again on a
    # new connection, and the client never sees the race.
    async def run():
        engine = RawServer()
        engine.drop_second_request = True
        port = await engine.start()
        sidecar = await start_sidecar(PdSidecar(f"http://127.0.0.1:{port}"))
        try:
            return [await _post(sidecar.url, {**BODY, "stream": False}) for _ in range(2)], engine
        finally:
            await sidecar.stop()
            await engine.stop()

    answers, engine = asyncio.run(run())
    assert [(status, body) for status, _, body in answers] == [(200, b'{"ok":1}')] * 2
    assert len(engine.requests) == 3 and engine.connections == 2


def test_a_failed_prefill_falls_back_to_the_decode_engine_and_says_so() -> None:
    async def test(url, prefiller, p, d):
        p.fail_with = 503
        status, headers, body = await _post(url, BODY, {PREFILLER_HEADER: prefiller})
        assert status == 200 and body == SSE
        assert headers[FALLBACK_HEADER.decode()] == "prefill_failed"
        assert "kv_transfer_params" not in d.seen[0][2]  # it prefilled itself
        status, headers, _ = await _post(url, BODY, {PREFILLER_HEADER: "127.0.0.1:1"})
        assert status == 200 and headers[FALLBACK_HEADER.decode()] == "prefill_failed"

    _with_stubs(test)


def test_a_prefill_the_engine_refuses_as_bad_is_the_clients_error() -> None:
    async def test(url, prefiller, p, d):
        p.fail_with = 400
        status, _, body = await _post(url, BODY, {PREFILLER_HEADER: prefiller})
        assert status == 400 and json.loads(body)["error"]["message"] == "boom"
        assert d.seen == []

    _with_stubs(test)


def test_bad_input_is_a_clear_400_and_no_engine_sees_it() -> None:
    async def test(url, prefiller, p, d):
        for body, headers in (
            (b"not json", {}),
            (b"[1, 2]", {}),
            (BODY, {PREFILLER_HEADER: "http://127.0.0.1:80"}),  # a URL, not host:port
        ):
            status, _, answer = await _post(url, body, headers)
            assert status == 400
            assert json.loads(answer)["error"]["type"] == "invalid_request_error"
        assert p.seen == [] and d.seen == []

    _with_stubs(test)


def test_other_paths_pass_to_the_decode_engine() -> None:
    async def test(url, prefiller, p, d):
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            assert r.status == 200 and await r.text() == "ok"
        async with aiohttp.ClientSession() as s, s.get(url + "/nowhere") as r:
            assert r.status == 404  # the engine's own answer

    _with_stubs(test)


def _leave_during_prefill(connector: KVConnector) -> tuple[int, int]:
    """Prefill and decode legs the engines saw when the client left early in a 2 s prefill
    (long enough for a loaded machine to notice the disconnect before it ends)."""

    async def test(url, prefiller, p, d):
        p.delay_s = 2.0
        async with aiohttp.ClientSession() as s:
            req = asyncio.ensure_future(
                s.post(url + "/v1/completions", json=BODY, headers={PREFILLER_HEADER: prefiller})
            )
            for _ in range(100):  # until the prefill leg arrived, bounded
                if p.seen:
                    break
                await asyncio.sleep(0.01)
            req.cancel()  # the client goes away mid-prefill
        await asyncio.sleep(2.5)  # past the prefill's answer
        return len(p.seen), len(d.seen)

    return _with_stubs(test, connector)


def test_a_client_leaving_during_the_prefill_aborts_it() -> None:
    # shared storage: the prefill leg is aborted and no decode leg follows (had the sidecar
    # missed the disconnect, the decode would have run after the prefill answered)
    assert _leave_during_prefill(KVConnector.SHARED_STORAGE) == (1, 0)
    # nixl: the prefill engine may already hold the prompt's blocks for a decode, so the
    # decode leg is delivered and aborted, which frees them (backends/vllm_pd.py)
    assert _leave_during_prefill(KVConnector.NIXL) == (1, 1)


def test_the_cli_refuses_bad_arguments_with_a_clear_error(capsys) -> None:
    import argparse

    from gateway.epp.sidecar_cli import add_arguments, main

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert main(p.parse_args(["--decode", "ftp://x"])) == 2
    assert "--decode must be an http(s) URL" in capsys.readouterr().err
    assert main(p.parse_args(["--decode", "http://127.0.0.1:1", "--timeout-s", "0"])) == 2
    assert "--timeout-s must be > 0" in capsys.readouterr().err


def test_a_header_that_is_not_utf8_does_not_break_the_request() -> None:
    async def test(url, prefiller, p, d):
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps(BODY).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        ).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + b"X-Note: caf\xe9\r\nConnection: close\r\n\r\n" + payload)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and SSE in answer.replace(b"\r\n", b"\n")

    _with_stubs(test)
