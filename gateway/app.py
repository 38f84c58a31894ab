"""The gateway's ASGI application: a plain-ASGI fast path for completions, Starlette for the rest.

``build_app(settings)`` returns an ASGI callable with ``.gateway`` attached; its lifespan
starts and stops the background work (health checks, scrapes, KV events, refits).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from config.settings import Settings
from gateway.admin import AdminAPI
from gateway.answers import send_json
from gateway.engine_passthrough import PASSTHROUGH_PATHS, EnginePassthrough
from gateway.openai import CHAT, COMPLETIONS, error_body
from gateway.openai_openapi import OPENAPI
from gateway.proxy import CompletionHandler
from gateway.responses_api import RESPONSES
from gateway.runtime import Gateway


class GatewayApp:
    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic):
        self.gateway = Gateway(settings, clock=clock)
        self._completions = CompletionHandler(self.gateway)
        passthrough = EnginePassthrough(self.gateway)  # the engines' /tokenize, /detokenize
        self._starlette = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                *[Route(path, passthrough.handle, methods=["POST"]) for path in PASSTHROUGH_PATHS],
                *AdminAPI(self.gateway, self._completions.tenants).routes(),
            ],
            # Unknown paths and wrong methods answer in OpenAI's error shape, like the rest.
            exception_handlers={HTTPException: self.http_error},
        )

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in (COMPLETIONS, CHAT, RESPONSES):
            if scope["method"] != "POST":
                body = error_body("use POST", "invalid_request_error")
                await send_json(send, 405, body, [(b"allow", b"POST")])
                return
            await self._completions(scope, receive, send)
            return
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self._starlette(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.gateway.startup()
                except Exception as exc:  # report instead of a traceback from the server
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.gateway.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- small Starlette endpoints ----
    async def models(self, request: Request) -> Response:
        """The configured models (names and aliases) or, with no ``models`` table, whatever
        the engines themselves serve."""
        ids = await self.gateway.served_models.ids(self.gateway.session)
        data = [{"id": m, "object": "model", "owned_by": "kvgate"} for m in ids]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if self.gateway.drain.draining:  # SIGTERM: load balancers stop sending here
            return JSONResponse({"status": "shutting down"}, status_code=503)
        c = self.gateway.conductor
        ok = any(i.eligible for i in c.instances.values())
        body = {
            "status": "ok" if ok else "no healthy instance",
            "instances": {iid: i.eligible for iid, i in c.instances.items()},
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.gateway.metrics.render(), media_type=self.gateway.metrics.content_type)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(OPENAPI)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": exc.detail, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def build_app(settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> GatewayApp:
    return GatewayApp(settings, clock=clock)
