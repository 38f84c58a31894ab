"""What both fuzz suites share: an emulated fleet on loopback, the in-process app, the checks.

The engines are two emulators (one prefill, one decode) on fixed loopback ports, run in a
background event loop; the gateway is the in-process ASGI app driven by Starlette's TestClient
(lifespan included). Checks: every answer is a success or a 4xx whose body is an OpenAI error
object; no ERROR record or traceback reached the log; the gateway's books are back at zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from starlette.testclient import TestClient

from config.loader import settings_from_dict
from config.settings import Role
from gateway.app import GatewayApp, build_app
from gateway.runtime import Gateway
from predictors.profiles import get_profile
from replay.emulator import EmulatorConfig, RunningEmulator, start_emulator

TOKEN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROFILE = "llama3-8b-h100-tp1"
MAX_BODY_BYTES = 256 * 1024
MAX_OUTPUT_TOKENS = 256
MODEL_LEN = (
    get_profile(PROFILE).kv_capacity_tokens
)  # the emulator refuses longer outputs  # small, so that the 413 path is reachable by the fuzzers


@dataclass
class Fleet:
    """Emulated engines in their own event loop thread (the app runs in TestClient's)."""

    ports: tuple[int, int]
    model_dir: str | None = None  # engine-exact tokens and chat template (gateway and engines)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    emulators: dict[str, RunningEmulator] = field(default_factory=dict)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        for (iid, role), port in zip(
            (("p0", Role.PREFILL), ("d0", Role.DECODE)), self.ports, strict=True
        ):
            cfg = EmulatorConfig(
                role=role,
                profile=PROFILE,
                port=port,
                time_scale=0.0001,
                model_dir=self.model_dir,
            )
            self.emulators[iid] = self._run(start_emulator(cfg))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        for emu in self.emulators.values():
            with contextlib.suppress(Exception):
                self._run(emu.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self.loop.close()

    def settings_dict(self) -> dict[str, Any]:
        def pool(iid: str, role: str) -> dict[str, Any]:
            inst = {"id": iid, "url": self.emulators[iid].url, "profile": PROFILE}
            return {"name": role, "role": role, "instances": [inst]}

        return {
            "server": {
                "admin_token": TOKEN,
                "health_interval_s": 30.0,
                "refit_interval_s": 0,
                "max_body_bytes": MAX_BODY_BYTES,
            },
            "pools": [pool("p0", "prefill"), pool("d0", "decode")],
            "routing": {"model_dir": self.model_dir} if self.model_dir else {},
        }


@contextlib.contextmanager
def fuzz_app(
    ports: tuple[int, int], model_dir: str | None = None
) -> Iterator[tuple[TestClient, GatewayApp]]:
    """A fresh fleet and app (so admin changes made by a fuzzer never outlive the module)."""
    fleet = Fleet(ports, model_dir)
    fleet.start()
    try:
        app = build_app(settings_from_dict(fleet.settings_dict()))
        with TestClient(app, base_url="http://testserver") as client:
            yield client, app
    finally:
        fleet.stop()


def assert_openai_error(response: Any) -> None:
    """A 4xx whose body is ``{"error": {"message", "type", "param", "code"}}``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err


def assert_good_answer(response: Any) -> None:
    """A success, or a 4xx with an OpenAI error body; never a 5xx."""
    if response.status_code < 400:
        return
    assert_openai_error(response)


def assert_books_at_zero(gw: Gateway) -> None:
    """Nothing in flight: no request record, no queued prefill, no decode slot or reservation."""
    c = gw.conductor
    assert not c.requests, f"requests still booked: {list(c.requests)[:5]}"
    for iid, inst in c.instances.items():
        assert not inst.prefill_queue, (iid, "prefill_queue", list(inst.prefill_queue))
        assert not inst.incoming, (iid, "incoming", list(inst.incoming))
        assert not inst.running, (iid, "running", list(inst.running))
        assert inst.batch == 0 and inst.reserved_tokens == 0, (iid, inst.batch)
        assert inst.incoming_tokens == 0, (iid, inst.incoming_tokens)
    assert not c.planner.in_flight
    drain = getattr(gw, "drain", None)  # requests between parse and the end of their answer
    if drain is not None:
        assert drain.active == 0, drain.active


class LogTrap(logging.Handler):
    """Collects WARNING+ records from every thread (the app runs in TestClient's thread)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def bad(self) -> list[str]:
        """ERROR records and anything carrying a traceback."""
        return [
            f"{r.name}: {r.getMessage()}"
            for r in self.records
            if r.levelno >= logging.ERROR or r.exc_info or "Traceback" in r.getMessage()
        ]


@contextlib.contextmanager
def trapped_logs() -> Iterator[LogTrap]:
    trap = LogTrap()
    root = logging.getLogger()
    root.addHandler(trap)
    try:
        yield trap
    finally:
        root.removeHandler(trap)


@dataclass
class Tally:
    """Answers by status class, for the suite's report (docs/reliability.md)."""

    name: str
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, status: int) -> None:
        key = f"{status // 100}xx"
        self.counts[key] = self.counts.get(key, 0) + 1

    def report(self) -> str:
        total = sum(self.counts.values())
        return f"{self.name}: {total} requests {json.dumps(dict(sorted(self.counts.items())))}"


def _short_answer(body: Any) -> Any:
    """A valid output length over ``MAX_OUTPUT_TOKENS`` lowered to it: the emulated engine
    would decode (and stream) every one of 200k tokens. Lengths past the engine's model
    length, and every invalid one, still go through as generated."""
    if not isinstance(body, dict):
        return body
    out = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = out.get(key)
        if type(value) is int and MAX_OUTPUT_TOKENS < value <= MODEL_LEN:
            out[key] = MAX_OUTPUT_TOKENS
    return out


def schemathesis_case_runner(
    client: TestClient, tally: Tally, headers: dict[str, str] | None = None
):
    """A function that sends one schemathesis ``Case`` through ``client`` and checks the answer:
    OpenAI-shaped 4xx or success, status and content type as the description says, bodies
    matching its response schemas."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]

    def run(case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url), headers=headers)
        kwargs.pop("cookies", None)
        if "json" in kwargs:  # serialized as schemathesis would, bytes as they are
            kwargs["content"] = json.dumps(_short_answer(kwargs.pop("json"))).encode()
        if "data" in kwargs:
            kwargs["content"] = kwargs.pop("data")
        response = client.request(**kwargs)
        tally.add(response.status_code)
        assert_good_answer(response)
        case.validate_response(response, checks=checks)

    return run
