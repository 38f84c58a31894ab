"""The engines' own tokenizer endpoints (``POST /tokenize``, ``POST /detokenize``), forwarded to
one healthy instance of the body's model, as the client sent them.

They need no placement: every instance of a model tokenizes alike, and nothing is cached or
computed on the GPU. So the body goes to the least loaded eligible instance of the model the
body names (or, with one model or none configured, of the fleet) and the engine's answer comes
back unchanged: the client speaks its engine's dialect (vLLM takes ``prompt`` or ``messages``,
llama.cpp ``content``). Tools that count tokens against vLLM (llm-d's token producer, eval
harnesses) work through kvgate as they do against the engine.
"""

from __future__ import annotations

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from gateway.answers import read_body
from gateway.openai import BadRequest, error_body, parse_head
from gateway.proxy_deps import ProxyGateway
from routing.fleet_pools import least_loaded

PASSTHROUGH_PATHS = ("/tokenize", "/detokenize")
_TIMEOUT_S = 30.0  # a tokenizer call: milliseconds on a healthy engine


class EnginePassthrough:
    def __init__(self, gw: ProxyGateway) -> None:
        self.gw = gw

    async def handle(self, request: Request) -> Response:
        gw = self.gw
        try:
            raw = await read_body(request.receive, gw.settings.server.max_body_bytes)
            model = self._model(raw)
        except ConnectionResetError:  # the client left
            return Response(status_code=499)
        except BadRequest as exc:
            kind = "invalid_request_error"
            return _error(exc.status, exc.message, kind, param=exc.param, code=exc.code)
        best = least_loaded(gw.conductor.pools.for_model(model).prefill, gw.clock())
        if best is None:
            return _error(503, "no healthy engine", "service_unavailable", code="no_healthy")
        target = gw.targets[best.id]
        if gw.session is None:  # before start-up finished
            return _error(503, "the gateway is starting", "service_unavailable")
        try:
            async with gw.session.post(
                target.url + request.url.path,
                data=raw,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S),
            ) as resp:
                body = await resp.read()
                return Response(body, resp.status, media_type=resp.content_type)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            msg = f"engine {target.instance_id} failed: {exc!r}"
            return _error(502, msg, "upstream_error")

    def _model(self, raw: bytes) -> str | None:
        """The served model the body names; None for the whole fleet (no ``models`` table).
        With one configured model a body without ``model`` means it (llama.cpp's bodies have
        none); raises BadRequest as the completion endpoints do."""
        models = self.gw.settings.models
        body = parse_head(raw or b"{}").body  # a JSON object, read as the completions' are
        if not models:
            return None
        if body.get("model") is None and len(models) == 1:
            return models[0].name
        return self.gw.parse_head(raw).route.name  # type: ignore[union-attr]


def _error(
    status: int, message: str, kind: str, *, param: str | None = None, code: str | None = None
) -> Response:
    return Response(
        error_body(message, kind, param=param, code=code), status, media_type="application/json"
    )
