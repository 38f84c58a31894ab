"""The endpoint picker's HTTP port: Prometheus ``/metrics``, ``/books`` (what is in flight) and
the admin API (``/admin/*``, gateway/admin.py: tune SLOs, policy and admission live, add,
drain and remove instances, reload the config, inspect state), as `kvgate serve` has them.

Starlette under uvicorn on the picker's event loop, without uvicorn's signal handlers: the
picker's own SIGTERM drain and SIGHUP reload stay in charge (gateway/epp/server.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admin import AdminAPI
from gateway.runtime import Gateway
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


@dataclass(slots=True)
class HttpSide:
    """The running HTTP server and the port it bound."""

    server: object  # uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self) -> None:
        self.server.should_exit = True  # type: ignore[attr-defined]
        await self.task


async def start_http(gw: Gateway, tenants: TenantGate, host: str, port: int) -> HttpSide:
    """Serve the port (0: an ephemeral one) until ``HttpSide.stop``."""
    import uvicorn

    from gateway.serve import quiet_server_class

    config = uvicorn.Config(
        http_app(gw, tenants), host=host, port=port, log_level="warning", lifespan="off"
    )
    server = quiet_server_class()(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # e.g. the port is taken: uvicorn logged why and exited
            task.result()
            raise OSError(f"cannot serve HTTP on {host}:{port}")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return HttpSide(server, task, bound)
