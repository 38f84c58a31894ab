"""The endpoint picker's servers: Envoy's ext_proc over gRPC, gRPC health, Prometheus metrics.

One grpc.aio server on the gateway's event loop (the Gateway's health checks, scrapes and
KV-event subscribers run there too). ``grpc.so_reuseport`` is off: with it on (gRPC's
default) a second or stale picker binds the same port and silently takes part of Envoy's
streams. Health (grpc.health.v1) answers for ``""``, ``liveness``, ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor``; readiness and the ext_proc service go
NOT_SERVING while draining, so Envoy's health check stops sending new streams first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.exchange import Exchange
from gateway.epp.picker import Picker
from gateway.epp.protocol import EXT_PROC_SERVICE, MessageTimeouts
from gateway.runtime import Gateway

log = logging.getLogger("kvgate.epp")
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 << 20),  # Envoy sends bodies in ≤ 62 kB pieces
    ("grpc.max_send_message_length", 64 << 20),
]


class ExternalProcessor(ext_grpc.ExternalProcessorServicer):
    """Envoy opens one bidirectional stream per HTTP request."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.streams = 0  # open streams, for tests and drain logs

    async def Process(  # the generated servicer's name
        self, request_iterator: AsyncIterator[ext.ProcessingRequest], context
    ) -> AsyncIterator[ext.ProcessingResponse]:
        exchange = Exchange(self.picker)
        self.streams += 1
        try:
            async for req in request_iterator:
                for reply in await exchange.handle(req):
                    yield reply
                while exchange.waiting:  # Envoy's timer is extended: now the wait
                    for reply in await exchange.resume():
                        yield reply
        except Exception:  # a bug must not leave the books open; Envoy sees the stream fail
            log.exception("ext_proc stream failed")
            exchange.close("failed")
            raise
        finally:
            exchange.close()  # no-op once the answer ended
            self.streams -= 1


@dataclass(slots=True)
class EppServer:
    """The running servers; ``port``, ``health_port`` and ``metrics_port`` as bound."""

    gateway: Gateway
    picker: Picker
    processor: ExternalProcessor
    grpc_server: grpc.aio.Server
    health_server: grpc.aio.Server | None
    health: health.HealthServicer
    metrics_runner: web.AppRunner | None
    port: int
    health_port: int
    metrics_port: int | None

    def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("readiness", EXT_PROC_SERVICE, ""):
            self.health.set(name, status)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (503 + Retry-After, health NOT_SERVING), let answers in
        flight end for ``timeout_s``, then stop the servers."""
        self.set_serving(False)
        gw = self.gateway
        gw.drain.begin(timeout_s)
        deadline = gw.clock() + timeout_s
        while gw.drain.active > 0 and gw.clock() < deadline:
            await asyncio.sleep(0.05)
        if gw.drain.active:
            log.warning("drain deadline: %d answers still in flight", gw.drain.active)

    async def stop(self, grace_s: float = 1.0) -> None:
        await self.grpc_server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(grace_s)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        await self.gateway.shutdown()


async def start_epp(
    gw: Gateway,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    health_port: int | None = None,
    metrics_port: int | None = None,
    fallbacks: int = 1,
    timeouts: MessageTimeouts | None = None,
) -> EppServer:
    """Starts the gateway's background work and the servers (port 0: an ephemeral port).
    ``health_port`` None: health is served on the ext_proc port (Envoy's check of the
    ext_proc cluster uses that); a separate one for Kubernetes probes is optional."""
    await gw.startup()
    picker = Picker(gw, fallbacks, timeouts)
    unresolved = picker.resolve_all()
    if unresolved:  # tried again when picked; a pick that still fails is Envoy's 500
        log.warning("engine host names not resolved yet: %s", ", ".join(unresolved))
    processor = ExternalProcessor(picker)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    server = grpc.aio.server(options=_GRPC_OPTIONS)
    ext_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        await gw.shutdown()
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    health_server, hport = None, bound
    if health_port is not None:
        health_server = grpc.aio.server(options=_GRPC_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        hport = health_server.add_insecure_port(f"{host}:{health_port}")
        await health_server.start()
    runner, mport = None, None
    if metrics_port is not None:
        runner, mport = await _start_metrics(gw, host, metrics_port)
    epp = EppServer(
        gw, picker, processor, server, health_server, health_servicer, runner, bound, hport, mport
    )
    for name in HEALTH_SERVICES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return epp


async def _start_metrics(gw: Gateway, host: str, port: int) -> tuple[web.AppRunner, int]:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=gw.metrics.render(), headers={"content-type": "text/plain"})

    async def books(_: web.Request) -> web.Response:
        # What is in flight: 0 and 0 when every answer has ended (tests and operators).
        return web.json_response(
            {"requests": len(gw.conductor.requests), "active": gw.drain.active}
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/books", books)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound


async def run_until_signal(epp: EppServer, drain_timeout_s: float) -> None:
    """SIGTERM / SIGINT: drain, then stop; a second one stops at once."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    draining: list[asyncio.Task[None]] = []

    def on_signal() -> None:
        if stop.is_set():  # the second signal: no more waiting
            for task in draining:
                task.cancel()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    draining.append(asyncio.create_task(epp.drain(drain_timeout_s)))
    with contextlib.suppress(asyncio.CancelledError):
        await draining[0]
    await epp.stop()
