"""The endpoint picker's HTTP port: Prometheus ``/metrics``, ``/books`` (what is in flight) and
the admin API (``/admin/*``, gateway/admin.py: tune SLOs, policy and admission live, add,
drain and remove instances, reload the config, inspect state), as `kvgate serve` has them.

Starlette under uvicorn on the picker's event loop, without uvicorn's signal handlers: the
picker's own SIGTERM drain and SIGHUP reload stay in charge (gateway/epp/server.py).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import AdminAPI
from gateway.runtime import Gateway
from gateway.serve import RunningServer, start_server
from gateway.tenants import TenantGate


def http_app(gw: Gateway, tenants: TenantGate) -> Starlette:
    async def metrics(_: Request) -> Response:
        return Response(gw.metrics.render(), media_type=gw.metrics.content_type)

    async def books(_: Request) -> Response:
        # What is in flight: 0 and 0 when every answer has ended (tests and operators).
        return JSONResponse({"requests": len(gw.conductor.requests), "active": gw.drain.active})

    return Starlette(
        routes=[
            Route("/metrics", metrics, methods=["GET"]),
            Route("/books", books, methods=["GET"]),
            *AdminAPI(gw, tenants).routes(),
        ]
    )


async def start_http(gw: Gateway, tenants: TenantGate, host: str, port: int) -> RunningServer:
    """Serve the port (0: an ephemeral one) until ``stop``."""
    keep_alive_s = gw.settings.server.keep_alive_s
    return await start_server(http_app(gw, tenants), host, port, keep_alive_s=keep_alive_s)
