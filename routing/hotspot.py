"""Hot-spot planner: which KV prefixes to copy where, and the bounds on doing so.

Reactive (Mooncake Algorithm 1, line 28-29): the request was placed away from the holder of its
long prefix and pulls it; the pull is a copy that stays at the destination.
Proactive (Mooncake §4.2.5.2): a prefix read often (decayed access rate) whose every holder is
the bottleneck (predicted queue above a threshold) is copied to the least-loaded non-holder.
Bounds: commands in flight in total and per destination, a cool-down per prefix, at most
``max_replicas`` holders, and never a copy the destination already holds or is receiving.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace

from config.settings import ReplicationSettings
from routing.estimates import STORE_SOURCE, PrefillOption
from routing.instance_books import InstanceState
from routing.types import PrefixMatch, ReplicationCommand, ReplicationReason, RequestInfo

_MAX_TRACKED_PREFIXES = 100_000


@dataclass(slots=True)
class _Rate:
    value: float
    at_s: float


@dataclass(slots=True)
class InFlight:
    command: ReplicationCommand
    attempts: int = 1
    start: int = 0  # where its blocks begin in the prompt that asked for them


class HotspotPlanner:
    def __init__(self, settings: ReplicationSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self._decay = math.log(2.0) / settings.rate_half_life_s
        self._rates: OrderedDict[int, _Rate] = OrderedDict()
        self._cooldown_until: dict[int, float] = {}
        self.in_flight: dict[str, InFlight] = {}
        self._to: dict[str, dict[str, InFlight]] = {}  # in flight, by destination
        self._pending: set[tuple[int, str]] = set()  # (prefix_key, destination)
        self._seq = 0
        self.issued = 0
        self.failed = 0
        self.confirmed = 0

    # ---- access rate ----
    def observe(self, req: RequestInfo, match: PrefixMatch, now: float) -> float:
        """Count one access to the request's cached prefix; returns its decayed rate (1/s)."""
        blocks = match.best_blocks
        if blocks < self.settings.min_prefix_blocks:
            return 0.0
        key = req.block_hashes[blocks - 1]
        r = self._rates.get(key)
        if r is None:
            r = _Rate(0.0, now)
            self._rates[key] = r
            if len(self._rates) > _MAX_TRACKED_PREFIXES:
                self._rates.popitem(last=False)
        else:
            self._rates.move_to_end(key)
        r.value = r.value * math.exp(-self._decay * max(now - r.at_s, 0.0)) + self._decay
        r.at_s = now
        return r.value

    def rate(self, prefix_key: int, now: float) -> float:
        r = self._rates.get(prefix_key)
        if r is None:
            return 0.0
        return r.value * math.exp(-self._decay * max(now - r.at_s, 0.0))

    # ---- bounds ----
    def can_issue(self, destination: str) -> bool:
        s = self.settings
        return (
            len(self.in_flight) < s.max_in_flight
            and len(self._to.get(destination, ())) < s.max_in_flight_per_destination
        )

    def _issue(
        self,
        source: str,
        destination: str,
        blocks: tuple[int, ...],
        reason: ReplicationReason,
        now: float,
        request_id: str | None,
        start: int,
    ) -> ReplicationCommand:
        self._seq += 1
        cmd = ReplicationCommand(
            command_id=f"rep-{self._seq}",
            source=source,
            destination=destination,
            block_hashes=blocks,
            tokens=len(blocks) * self.block_size,
            reason=reason,
            prefix_key=blocks[-1],
            issued_s=now,
            request_id=request_id,
        )
        entry = self.in_flight[cmd.command_id] = InFlight(cmd, start=start)
        self._to.setdefault(destination, {})[cmd.command_id] = entry
        self._pending.add((cmd.prefix_key, destination))
        if len(self._cooldown_until) >= _MAX_TRACKED_PREFIXES:  # bounded: drop the expired
            self._cooldown_until = {k: t for k, t in self._cooldown_until.items() if t > now}
        self._cooldown_until[cmd.prefix_key] = now + self.settings.cooldown_s
        self.issued += 1
        return cmd

    # ---- planning ----
    def plan(
        self,
        req: RequestInfo,
        match: PrefixMatch,
        candidates: list[InstanceState],
        instances: Mapping[str, InstanceState],
        option: PrefillOption,
        now: float,
    ) -> tuple[ReplicationCommand, ...]:
        """The commands one placement issues: a pull it relies on (reactive) and a proactive
        copy of its prefix if that is hot and every holder is busy."""
        rate = self.observe(req, match, now)
        cmds: list[ReplicationCommand] = []
        if option.pull_source not in (None, STORE_SOURCE):
            cmd = self.reactive(
                req,
                option.pull_source,
                option.instance.id,
                option.pull_from_block,
                option.cached_blocks,
                now,
            )
            if cmd is not None:
                cmds.append(cmd)
        cmd = self.proactive(req, match, candidates, instances, rate, option.instance.id, now)
        if cmd is not None:
            cmds.append(cmd)
        return tuple(cmds)

    def reactive(
        self,
        req: RequestInfo,
        source: str,
        destination: str,
        from_block: int,
        to_block: int,
        now: float,
    ) -> ReplicationCommand | None:
        """The pull a placement relies on. Not subject to cool-down: the request needs it."""
        blocks = req.block_hashes[from_block:to_block]
        if not blocks or (blocks[-1], destination) in self._pending:
            return None
        return self._issue(
            source, destination, blocks, ReplicationReason.REACTIVE, now, req.request_id, from_block
        )

    def proactive(
        self,
        req: RequestInfo,
        match: PrefixMatch,
        candidates: list[InstanceState],
        by_id: Mapping[str, InstanceState],
        rate: float,
        exclude: str | None,
        now: float,
    ) -> ReplicationCommand | None:
        """Copy a hot prefix whose holders are all busy to the least-loaded non-holder."""
        s = self.settings
        blocks = match.best_blocks
        if not s.enabled or rate < s.hot_rate_per_s or blocks < s.min_prefix_blocks:
            return None
        key = req.block_hashes[blocks - 1]
        if self._cooldown_until.get(key, -math.inf) > now:
            return None
        holders = [by_id[h] for h in match.best_holders if h in by_id]
        if not holders or len(holders) >= s.max_replicas:
            return None
        source = min(holders, key=lambda h: (h.queue_time(now), h.bit_order))
        if source.queue_time(now) < s.holder_queue_threshold_s:
            return None
        dest = None
        for inst in candidates:
            if inst.id == exclude or match.local_blocks.get(inst.id, 0) >= blocks:
                continue
            if (key, inst.id) in self._pending or not self.can_issue(inst.id):
                continue
            if dest is None or inst.queue_time(now) < dest.queue_time(now):
                dest = inst
        if dest is None or dest.queue_time(now) >= source.queue_time(now):
            return None
        local = match.local_blocks.get(dest.id, 0)
        return self._issue(
            source.id,
            dest.id,
            req.block_hashes[local:blocks],
            ReplicationReason.PROACTIVE,
            now,
            None,
            local,
        )

    def pulls_into(self, destination: str, req: RequestInfo, cached_tokens: int) -> tuple[str, ...]:
        """Other requests' pulls in flight to ``destination`` whose first block is among the
        ``cached_tokens`` of ``req``'s prompt its prediction counts as cached there. The
        pulling request's dispatch already books its whole prompt at ``destination``, so a
        later request sharing the prefix counts on blocks still on the wire; sent at once, it
        would be prefilled before they land and recompute them (docs/experiments.md §2.3,
        "Requests that count on another request's pull"). Proactive copies are not booked
        before they land, so only pulls are named."""
        found: tuple[str, ...] = ()
        if not cached_tokens or not (to := self._to.get(destination)):
            return found  # on every decision: the common case costs one lookup
        counted = cached_tokens // self.block_size
        for cid, entry in to.items():
            cmd = entry.command
            # Keys are chained: the same key at the pull's first position means the same prefix.
            if (
                entry.start < counted
                and cmd.request_id not in (None, req.request_id)
                and req.block_hashes[entry.start] == cmd.block_hashes[0]
            ):
                found += (cid,)
        return found

    # ---- lifecycle ----
    def complete(self, command_id: str, ok: bool, now: float) -> ReplicationCommand | None:
        """Record a copy's outcome. A failure is retried (returned as a new command) at most
        ``max_retries`` times; the KV index is only updated by the caller on success."""
        entry = self.in_flight.pop(command_id, None)
        if entry is None:
            return None
        cmd = entry.command
        self._to[cmd.destination].pop(command_id)
        if ok:
            self._pending.discard((cmd.prefix_key, cmd.destination))
            self.confirmed += 1
            return None
        self.failed += 1
        if entry.attempts > self.settings.max_retries:
            self._pending.discard((cmd.prefix_key, cmd.destination))
            return None
        self._seq += 1
        retry = replace(cmd, command_id=f"rep-{self._seq}", issued_s=now)
        again = self.in_flight[retry.command_id] = InFlight(retry, entry.attempts + 1, entry.start)
        self._to[cmd.destination][retry.command_id] = again
        return retry

    def drop(self, command_id: str) -> None:
        """Forget a command without retrying it (a dry-run sink executes nothing)."""
        entry = self.in_flight.pop(command_id, None)
        if entry is not None:
            cmd = entry.command
            self._to[cmd.destination].pop(command_id)
            self._pending.discard((cmd.prefix_key, cmd.destination))

    def expire(self, now: float) -> list[ReplicationCommand]:
        """Commands past the timeout count as failed; returns the retries to execute."""
        retries = []
        limit = self.settings.timeout_s
        for cid in [c for c, e in self.in_flight.items() if now - e.command.issued_s > limit]:
            retry = self.complete(cid, ok=False, now=now)
            if retry is not None:
                retries.append(retry)
        return retries

    def forget_instance(self, instance_id: str) -> None:
        for cid in [
            c
            for c, e in self.in_flight.items()
            if instance_id in (e.command.source, e.command.destination)
        ]:
            cmd = self.in_flight.pop(cid).command
            self._to[cmd.destination].pop(cid)
            self._pending.discard((cmd.prefix_key, cmd.destination))
