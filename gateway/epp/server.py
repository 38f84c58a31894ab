"""The endpoint picker's servers: Envoy's ext_proc over gRPC, gRPC health, and an HTTP port for
metrics and the admin API (gateway/epp/http_side.py).

One grpc.aio server on the gateway's event loop (the Gateway's health checks, scrapes and
KV-event subscribers run there too). ``grpc.so_reuseport`` is off: with it on (gRPC's
default) a second or stale picker binds the same port and silently takes part of Envoy's
streams. Health (grpc.health.v1) answers for ``""``, ``liveness``, ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor``; readiness and the ext_proc service go
NOT_SERVING while draining, so Envoy's health check stops sending new streams first. SIGHUP
reloads the config file as `kvgate serve` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.exchange import Exchange
from gateway.epp.http_side import start_http
from gateway.epp.picker import Picker
from gateway.epp.protocol import EXT_PROC_SERVICE, MessageTimeouts
from gateway.runtime import Gateway
from gateway.serve import RunningServer

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
    http: RunningServer | None  # /metrics, /books and the admin API (--metrics-port)
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
        if self.http is not None:
            await self.http.stop()
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
    gw.health_via_sidecars = True  # Envoy reaches P/D decode instances through them
    await gw.startup()
    picker = Picker(gw, fallbacks, timeouts)
    unresolved = picker.addresses.resolve_all()
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
    http = None
    if metrics_port is not None:
        try:
            http = await start_http(gw, picker.tenants, host, metrics_port)
        except BaseException:  # e.g. the port is taken: stop what started, then say why
            await server.stop(0)
            if health_server is not None:
                await health_server.stop(0)
            await gw.shutdown()
            raise
    mport = http.port if http is not None else None
    epp = EppServer(
        gw, picker, processor, server, health_server, health_servicer, http, bound, hport, mport
    )
    for name in HEALTH_SERVICES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return epp


async def run_until_signal(epp: EppServer, drain_timeout_s: float) -> None:
    """SIGTERM / SIGINT: drain, then stop; a second one stops at once. SIGHUP: reload the
    config file (gateway/reload.py, as `kvgate serve` does)."""
    import signal

    from gateway.reload import reload_config

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    draining: list[asyncio.Task[None]] = []
    reloads: set[asyncio.Task[object]] = set()

    def on_hangup() -> None:
        task = loop.create_task(reload_config(epp.gateway))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hangup)

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
