"""Replication sinks: what executes a ``ReplicationCommand`` from the hot-spot planner.

A sink copies a command's blocks from its source to its destination and reports back one
``ReplicationResult``. Contract every sink keeps:

- ``execute`` never blocks the event loop (blocking client calls go to a thread) and returns
  within the command's timeout; it may take that long, so the caller runs it as a task and the
  request path never awaits it.
- ``ok`` is true only once the copy is confirmed: only then may the caller record that the
  destination holds the blocks (``Conductor.replication_done(..., ok=True)``).
- ``NOT_EXECUTED`` means nothing was attempted (dry run, sink unable to take the command): the
  caller releases the command (``Conductor.replication_dropped``) and does not retry it.
- Sinks retry internally up to ``ReplicationSettings.max_retries``; ``attempts`` says how many
  were made, so the caller need not retry a failed result again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from routing.types import ReplicationCommand


class Outcome(StrEnum):
    OK = "ok"  # copy confirmed: the destination holds the blocks
    FAILED = "failed"  # attempted and failed (after the sink's own retries)
    TIMEOUT = "timeout"  # not confirmed within the timeout; the copy may still land later
    NOT_EXECUTED = "not_executed"  # nothing attempted (e.g. dry run)


@dataclass(frozen=True, slots=True)
class ReplicationResult:
    command_id: str
    outcome: Outcome
    latency_s: float = 0.0
    bytes: int = 0  # bytes confirmed at the destination (0 when unknown)
    error: str | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def executed(self) -> bool:
        return self.outcome is not Outcome.NOT_EXECUTED


@runtime_checkable
class ReplicationSinkProtocol(Protocol):
    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult: ...


class DryRunSink:
    """Records commands and executes none of them (the default sink)."""

    def __init__(self, keep: int = 1000) -> None:
        self.commands: deque[ReplicationCommand] = deque(maxlen=keep)

    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        self.commands.append(cmd)
        return ReplicationResult(cmd.command_id, Outcome.NOT_EXECUTED, error="dry_run")


@runtime_checkable
class ManagedSink(Protocol):
    """A sink with a connection to open at start-up and close at shutdown."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class SinkByDestination:
    """Per-pool sinks: each command runs on the sink of its destination's pool.

    ``sink_of`` names the sink for an instance id (the pool's ``replication_sink`` or the
    default); a name without a sink here (a dry-run pool, an unknown instance) executes nothing.
    """

    def __init__(
        self,
        sinks: Mapping[str, ReplicationSinkProtocol],
        sink_of: Callable[[str], str],
    ) -> None:
        self._sinks = dict(sinks)
        self._sink_of = sink_of

    async def execute(self, cmd: ReplicationCommand) -> ReplicationResult:
        name = self._sink_of(cmd.destination)
        sink = self._sinks.get(name)
        if sink is None:
            error = f"no {name} sink for destination {cmd.destination}"
            return ReplicationResult(cmd.command_id, Outcome.NOT_EXECUTED, error=error)
        return await sink.execute(cmd)

    async def start(self) -> None:
        for sink in self._sinks.values():
            if isinstance(sink, ManagedSink):
                await sink.start()

    async def close(self) -> None:
        for sink in self._sinks.values():
            if isinstance(sink, ManagedSink):
                await sink.close()
