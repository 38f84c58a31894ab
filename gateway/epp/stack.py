"""A live Envoy + `kvgate epp` stack on loopback: engine emulators (or given engine URLs), a
Gateway running the picker in this event loop, and a real Envoy process in front.

Used by the tests (tests/gateway/epp/) and bench/epp_overhead.py. Everything binds
127.0.0.1; ``stop()`` ends exactly what ``start()`` started (Envoy by its PID).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from config.settings import (
    InstanceSettings,
    KVConnector,
    PDProtocol,
    PoolSettings,
    Role,
    Settings,
)
from gateway.epp.envoy import envoy_config, fleet_endpoints, start_envoy
from gateway.epp.pd_sidecar import PdSidecar
from gateway.epp.protocol import MessageTimeouts
from gateway.epp.server import EppServer, start_epp
from gateway.epp.sidecar_cli import start_sidecar
from gateway.runtime import Gateway
from gateway.serve import RunningServer
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class EppStackSpec:
    engines: int = 2  # colocated emulators (ignored when ``urls`` is given)
    # P/D instead: this many prefill and as many decode emulators (vLLM NIXL-style), a
    # `kvgate pd-sidecar` in front of each decode one (Envoy's endpoints: the sidecars)
    pd: int = 0
    urls: tuple[str, ...] = ()  # engines already running (e.g. bench/stub_engine.py)
    # ... or instances already running, as they are, except that a decode instance without a
    # sidecar_url gets a `kvgate pd-sidecar` started here (e.g. a real vLLM NIXL pair)
    instances: tuple[InstanceSettings, ...] = ()
    profile: str = "llama3-8b-h100-tp1"
    model: str | None = None  # the emulators' served model name; None = the profile's
    time_scale: float = 0.05
    block_size: int = 16
    kv_events: bool = True
    fail_open: bool = False
    fallbacks: int = 1
    health_interval_s: float = 0.5  # the gateway's engine probes (real CPU engines: longer)
    timeouts: MessageTimeouts = field(default_factory=MessageTimeouts)  # Envoy's, and the picker's
    workdir: Path = Path("/tmp/epp")
    base: Settings = field(default_factory=Settings)


class EppStack:
    def __init__(self, spec: EppStackSpec) -> None:
        self.spec = spec
        self.emulators: dict[str, RunningEmulator] = {}
        self.sidecars: dict[str, RunningServer] = {}  # decode instance id -> its sidecar
        self.gateway: Gateway | None = None
        self.epp: EppServer | None = None
        self.envoy: subprocess.Popen[bytes] | None = None
        self.envoy_port = 0
        self.epp_port = 0
        self.settings: Settings | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    async def _sidecar_for(self, inst: InstanceSettings) -> InstanceSettings:
        if inst.role is not Role.DECODE or inst.sidecar_url is not None:
            return inst
        app = PdSidecar(inst.url, inst.kv_connector or KVConnector.NIXL)
        self.sidecars[inst.id] = await start_sidecar(app)
        return replace(inst, sidecar_url=self.sidecars[inst.id].url)

    async def _instances(self) -> list[InstanceSettings]:
        s = self.spec
        if s.instances:
            return [await self._sidecar_for(i) for i in s.instances]
        if s.urls:
            return [
                InstanceSettings(id=f"e{i}", url=u, role=Role.BOTH, protocol=PDProtocol.VLLM)
                for i, u in enumerate(s.urls)
            ]
        roles = [(f"c{i}", Role.BOTH) for i in range(s.engines)]
        if s.pd:
            pd = (Role.PREFILL, Role.DECODE)
            roles = [(f"{r.value[0]}{i}", r) for r in pd for i in range(s.pd)]
        out = []
        for iid, role in roles:
            emu = await start_emulator(
                EmulatorConfig(
                    role=role,
                    profile=s.profile,
                    model=s.model,
                    port=0,
                    time_scale=s.time_scale,
                    block_size=s.block_size,
                    kv_events_port=0 if s.kv_events else None,
                )
            )
            self.emulators[iid] = emu
            inst = InstanceSettings(
                id=iid,
                url=emu.url,
                role=role,
                protocol=PDProtocol.VLLM,
                profile=s.profile,
                kv_events_endpoint=emu.kv_events_endpoint,
                kv_events_bind=False if emu.kv_events_endpoint else None,
            )
            out.append(await self._sidecar_for(inst))
        return out

    async def start(self) -> None:
        s = self.spec
        instances = await self._instances()
        base = s.base
        by_role: dict[Role, list[InstanceSettings]] = {}
        for inst in instances:
            by_role.setdefault(inst.role, []).append(inst)
        self.settings = replace(
            base,
            pools=tuple(PoolSettings(r.value, r, tuple(v)) for r, v in by_role.items()),
            routing=replace(base.routing, block_size=s.block_size),
            predictors=replace(base.predictors, profile=s.profile),
            server=replace(base.server, health_interval_s=s.health_interval_s),
        )
        self.gateway = Gateway(self.settings)
        self.epp = await start_epp(self.gateway, port=0, fallbacks=s.fallbacks, timeouts=s.timeouts)
        self.epp_port = self.epp.port
        await self.start_envoy()

    async def start_envoy(self) -> None:
        assert self.settings is not None
        engines, per_connection = fleet_endpoints(self.settings)
        self.envoy_port = free_port()
        config = envoy_config(
            listen=("127.0.0.1", self.envoy_port),
            epp=("127.0.0.1", self.epp_port),
            engines=engines,
            fail_open=self.spec.fail_open,
            retries=max(1, self.spec.fallbacks),
            timeouts=self.spec.timeouts,
            requests_per_connection=per_connection,
        )
        self.envoy = start_envoy(config, self.spec.workdir)
        await self._wait_envoy(30.0)

    async def _wait_envoy(self, timeout_s: float) -> None:
        """Until Envoy listens (its listener opens after the config loaded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.envoy is not None
            if self.envoy.poll() is not None:
                log = (self.spec.workdir / "envoy.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy exited ({self.envoy.returncode}): {log}")
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", self.envoy_port)
                writer.close()
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("envoy did not start listening")

    async def stop_epp(self) -> None:
        """Kill the picker only (Envoy stays): what a dead EPP looks like to Envoy."""
        if self.epp is not None:
            await self.epp.grpc_server.stop(0)

    def stop_envoy(self) -> None:
        if self.envoy is not None and self.envoy.poll() is None:
            self.envoy.terminate()
            try:
                self.envoy.wait(10)
            except subprocess.TimeoutExpired:
                self.envoy.kill()
                self.envoy.wait(5)
        self.envoy = None

    async def stop(self) -> None:
        self.stop_envoy()
        if self.epp is not None:
            with contextlib.suppress(Exception):
                await self.epp.stop(0)
        for sidecar in self.sidecars.values():
            with contextlib.suppress(Exception):
                await sidecar.stop()
        self.sidecars.clear()
        for emu in self.emulators.values():
            with contextlib.suppress(Exception):
                await emu.stop()
        self.emulators.clear()
