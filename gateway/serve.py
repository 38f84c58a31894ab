"""`kvgate serve`: run the gateway with uvicorn (uvloop + httptools when available).

Signals are the gateway's own, handled on the event loop (``loop.add_signal_handler``, never
a blocking call in a handler), not uvicorn's: uvicorn's SIGTERM closes the listening socket
at once (new clients get "connection refused", not an answer saying why) and re-raises the
signal once it has stopped, so the process ends by the signal rather than with exit code 0.

- SIGTERM or SIGINT: drain (gateway/drain.py): new requests get 503 + Retry-After, answers in
  flight may finish for ``server.drain_timeout_s``, the rest end with a clean error; then the
  server stops and the process exits 0. A second SIGTERM/SIGINT stops at once.
- SIGHUP: reload the config file (gateway/reload.py), validated like at start-up; a bad
  file changes nothing and is logged with its file and line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from config.settings import KEEP_ALIVE_S, Settings

if TYPE_CHECKING:
    import uvicorn

    from gateway.app import GatewayApp

log = logging.getLogger("kvgate.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="kvgate TOML config (pools, SLOs, policy)")
    p.add_argument("--host", help="listen address (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default: server.port, 8000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def quiet_server_class() -> type[uvicorn.Server]:
    import uvicorn

    class GatewayServer(uvicorn.Server):
        """uvicorn's server without its signal handlers (the gateway installs its own)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return GatewayServer


@dataclasses.dataclass(slots=True)
class RunningServer:
    """A uvicorn server on this event loop (``start_server``) and the port it bound."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_server(
    app: object,
    host: str,
    port: int,
    *,
    lifespan: str = "off",
    signals: bool = False,
    keep_alive_s: float = KEEP_ALIVE_S,
) -> RunningServer:
    """Serve the ASGI ``app`` on ``host:port`` (0: an ephemeral port) in this event loop until
    ``stop``; ``signals``: uvicorn handles SIGINT/SIGTERM, else the caller keeps its own;
    ``keep_alive_s``: how long an idle client connection stays open."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan=lifespan,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # a float works
    )
    server = uvicorn.Server(config) if signals else quiet_server_class()(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # e.g. the port is taken: uvicorn logged why and exited
            task.result()
            raise OSError(f"cannot serve HTTP on {host}:{port}")
        await asyncio.sleep(0.01)
    return RunningServer(server, task, server.servers[0].sockets[0].getsockname()[1])


class Lifecycle:
    """The gateway's answers to signals, on the event loop."""

    def __init__(self, app: GatewayApp, server: uvicorn.Server) -> None:
        self.app, self.server = app, server
        self._tasks: set[asyncio.Task[object]] = set()
        self._stopping = False

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self.reload)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        if self._stopping:  # the second signal: stop now, whatever is still in flight
            log.warning("second stop signal: exiting without waiting")
            self.app.gateway.drain.abort_all()
            self.server.should_exit = self.server.force_exit = True
            return
        self._stopping = True
        self._spawn(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        gw = self.app.gateway
        timeout = gw.settings.server.drain_timeout_s
        log.warning(
            "stop signal: draining %d requests in flight (up to %.1f s)", gw.drain.active, timeout
        )
        report = await gw.drain.run(timeout)
        log.warning(
            "drained in %.2f s: %d finished, %d aborted",
            report.waited_s,
            report.finished,
            report.aborted,
        )
        self.server.should_exit = True

    def reload(self) -> None:
        from gateway.reload import reload_config

        self._spawn(reload_config(self.app.gateway))


async def serve(app: GatewayApp, config: uvicorn.Config) -> None:
    server = quiet_server_class()(config)
    Lifecycle(app, server).install(asyncio.get_running_loop())
    await server.serve()


def server_config(
    app: GatewayApp, settings: Settings, host: str, port: int, log_level: str
) -> uvicorn.Config:
    """uvicorn's config for `kvgate serve`."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        proxy_headers=False,  # this is the proxy: no X-Forwarded-* rewriting per request
        server_header=False,
        lifespan="on",
        # The drain has ended every answer by the time uvicorn stops: this only bounds
        # connections that are still open then (idle keep-alives close at once).
        timeout_graceful_shutdown=5,
        timeout_keep_alive=settings.server.keep_alive_s,  # type: ignore[arg-type]  # float works
    )


def main(args: argparse.Namespace) -> int:
    from config.errors import KvgateError
    from config.loader import load_settings
    from gateway.app import build_app

    try:
        settings = load_settings(args.config)
        app = build_app(settings)
    except (KvgateError, OSError, ValueError) as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    app.gateway.config_path = args.config
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from gateway.gc_tuning import tune_gc

    tune_gc()  # the process is this gateway's alone: tune the cyclic GC for it
    host = args.host or settings.server.host
    port = args.port or settings.server.port
    n = len(settings.instances())
    print(
        f"kvgate: serving {n} instances on http://{host}:{port} "
        f"(policy {settings.routing.policy}, admission {settings.admission.mode})",
        file=sys.stderr,
    )
    config = server_config(app, settings, host, port, args.log_level)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(serve(app, config))
    return 0
