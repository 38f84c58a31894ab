"""The proxy's seam: the handler (and its tenant gate) reach the gateway only through
``ProxyGateway``. A gateway wrapped so that it exposes nothing else serves streamed and whole
answers, a rejection and a bad request exactly as before."""

from __future__ import annotations

import asyncio
import typing

import aiohttp

from config.loader import settings_from_dict
from config.settings import Role
from gateway.app import build_app
from gateway.proxy import CompletionHandler
from gateway.proxy_deps import ProxyGateway
from replay.emulator import EmulatorConfig, start_emulator
from tests.gateway.live import serving

ALLOWED = set(typing.get_type_hints(ProxyGateway)) | {
    n for n in vars(ProxyGateway) if not n.startswith("_") and callable(getattr(ProxyGateway, n))
}


class _OnlyTheSeam:
    """The gateway as the seam declares it: any other attribute is an AttributeError."""

    def __init__(self, gw: object) -> None:
        self._gw = gw

    def __getattr__(self, name: str) -> object:
        if name not in ALLOWED:
            raise AttributeError(f"the proxy reached past its seam for {name!r}")
        return getattr(self._gw, name)


def test_the_gateway_is_a_proxy_gateway_and_the_handler_needs_no_more() -> None:
    async def run() -> list[tuple[int, str]]:
        engine = await start_emulator(EmulatorConfig(role=Role.BOTH, port=0, time_scale=0.01))
        settings = settings_from_dict(
            {
                "server": {"health_interval_s": 30.0, "refit_interval_s": 0},
                "slo": {"min_ttft_s": 1e-6},  # lets the third request ask for the impossible
                "admission": {"mode": "early"},
                "pools": [
                    {"name": "w", "role": "both", "instances": [{"id": "e0", "url": engine.url}]}
                ],
            }
        )
        app = build_app(settings)
        assert isinstance(app.gateway, ProxyGateway)
        app._completions = CompletionHandler(_OnlyTheSeam(app.gateway))  # type: ignore[arg-type]
        out = []
        try:
            async with serving(app) as url, aiohttp.ClientSession() as s:
                for body, headers in (
                    ({"prompt": "seam " * 30, "max_tokens": 3, "stream": True}, {}),
                    ({"prompt": "seam " * 30, "max_tokens": 3}, {}),
                    ({"prompt": "seam " * 30, "max_tokens": 3}, {"x-slo-ttft-ms": "0.001"}),
                    ({"prompt": 5, "max_tokens": 3}, {}),
                ):
                    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                        out.append((r.status, (await r.text())[:120]))
        finally:
            await engine.stop()
        return out

    out = asyncio.run(asyncio.wait_for(run(), 60))
    assert [status for status, _ in out] == [200, 200, 429, 400], out
    assert out[0][1].startswith("data: {") and '"text_completion"' in out[1][1]
