"""A live stack on loopback: engine emulators plus a kvgate gateway, in one event loop.

Used by `kvgate demo`, the live-vs-simulated agreement run and the end-to-end tests. Everything
binds 127.0.0.1 on ephemeral ports; ``stop()`` ends exactly what ``start()`` started.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace

from config.settings import InstanceSettings, PDProtocol, PoolSettings, Role, Settings
from gateway.app import build_app
from gateway.serve import RunningServer, start_server
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator


@dataclass(frozen=True, slots=True)
class StackSpec:
    prefill: int = 2
    decode: int = 2
    colocated: int = 0
    protocol: PDProtocol = PDProtocol.VLLM
    profile: str = "llama3-8b-h100-tp1"
    model: str | None = None  # the emulators' served model name; None = the profile's
    time_scale: float = 0.05
    block_size: int = 16
    kv_events: bool = True
    decode_tbt_limit_ms: float | None = None
    cache_capacity_tokens: int | None = None
    lora_load_s: float = 0.0  # each emulator's read of an adapter not in host memory
    base: Settings = field(default_factory=Settings)


class LiveStack:
    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.emulators: dict[str, RunningEmulator] = {}
        self.settings: Settings | None = None
        self.server: RunningServer | None = None
        self.url = ""
        self.app = None

    def _roles(self) -> list[tuple[str, Role]]:
        s = self.spec
        if s.colocated:
            return [(f"c{i}", Role.BOTH) for i in range(s.colocated)]
        return [(f"p{i}", Role.PREFILL) for i in range(s.prefill)] + [
            (f"d{i}", Role.DECODE) for i in range(s.decode)
        ]

    async def start(self) -> None:
        s = self.spec
        for iid, role in self._roles():
            self.emulators[iid] = await start_emulator(
                EmulatorConfig(
                    role=role,
                    protocol=s.protocol,
                    profile=s.profile,
                    model=s.model,
                    port=0,
                    time_scale=s.time_scale,
                    block_size=s.block_size,
                    kv_events_port=0 if s.kv_events else None,
                    decode_tbt_limit_ms=s.decode_tbt_limit_ms if role is not Role.PREFILL else None,
                    cache_capacity_tokens=s.cache_capacity_tokens,
                    # The adapters the gateway is told of (routing.lora_adapters) are served.
                    lora_adapters=tuple((n, n) for n in s.base.routing.lora_adapters),
                    lora_load_s=s.lora_load_s,
                    bootstrap_port=0
                    if (s.protocol is PDProtocol.SGLANG and role is Role.PREFILL)
                    else None,
                )
            )
        by_role: dict[Role, list[InstanceSettings]] = {}
        for iid, role in self._roles():
            emu = self.emulators[iid]
            by_role.setdefault(role, []).append(
                InstanceSettings(
                    id=iid,
                    url=emu.url,
                    role=role,
                    protocol=s.protocol,
                    profile=s.profile,
                    capacity_tokens=s.cache_capacity_tokens if role is not Role.DECODE else None,
                    bootstrap_port=emu.bootstrap_port if s.protocol is PDProtocol.SGLANG else None,
                    kv_events_endpoint=emu.kv_events_endpoint,
                    # The emulator's publisher binds (as vLLM's does for tcp://*:P): connect.
                    kv_events_bind=False if emu.kv_events_endpoint else None,
                )
            )
        base = s.base
        self.settings = replace(
            base,
            pools=tuple(PoolSettings(r.value, r, tuple(v)) for r, v in by_role.items()),
            routing=replace(base.routing, block_size=s.block_size),
            predictors=replace(base.predictors, profile=s.profile),
            server=replace(
                base.server,
                host="127.0.0.1",
                port=0,
                health_interval_s=min(base.server.health_interval_s, 0.5),
            ),
        )
        self.app = build_app(self.settings)
        keep_alive_s = self.settings.server.keep_alive_s
        self.server = await start_server(
            self.app, "127.0.0.1", 0, lifespan="on", signals=True, keep_alive_s=keep_alive_s
        )
        self.url = self.server.url

    @property
    def gateway(self):  # the running Gateway (books, metrics, learner)
        return self.app.gateway if self.app is not None else None

    async def stop(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.stop(), 10)
        for emu in self.emulators.values():
            with contextlib.suppress(Exception):
                await emu.stop()
        self.emulators.clear()
