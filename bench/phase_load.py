"""Open-loop phased load through a live gateway: consecutive phases of Poisson arrivals at given
rates (``Phase``), every request a streamed token-id completion sent at its arrival time whether
or not earlier ones have finished (``replay.live.loadgen``'s request client), with control pings
of the gateway's and one engine's ``/health``, optional samples of the gateway's RSS and books,
and the rejection probe alongside. The overload, soak and real-engine overload benchmarks drive
their fleets with it (``bench.overload_soak``, ``bench.real_overload``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from bench.emulated_fleet import EmulatedFleet
from bench.overload_report import Phase, PhaseRun, Sample
from bench.rejection_path import live_probe_rows, start_live_probe
from replay.live.loadgen import LoadOptions, prompt_ids, send_one
from replay.report.results import Outcome, RequestOutcome
from replay.workload.synthetic import SyntheticSpec, fixed, generate, lognormal
from replay.workload.traces import TraceRequest

DRAIN_S = 30.0  # after the last arrival, how long answers may still take
PING_S = 0.5  # period of the /health control pings
MAX_PENDING = 5000  # client requests open at once; beyond this the run is cut short


# ---------------------------------------------------------------- workload
def phase_trace(
    phases: list[Phase], input_tokens: int, output_tokens: int, seed: int
) -> list[tuple[int, TraceRequest]]:
    """(phase index, request) in arrival order. Each phase gets its own hash-id range, so
    prefixes (8 shared system prompts, half the requests) repeat within a phase only."""
    out: list[tuple[int, TraceRequest]] = []
    t0, id_offset = 0.0, 0
    for k, ph in enumerate(phases):
        spec = SyntheticSpec(
            requests=None,
            duration_s=ph.duration_s,
            rate_rps=ph.rate_rps,
            input_len=lognormal(input_tokens, 0.3, low=64, high=4 * input_tokens),
            output_len=fixed(output_tokens),
            families=8,
            family_fraction=0.5,
            family_prefix_blocks=1,
            seed=seed + k,
        )
        reqs = generate(spec)
        top = 0
        for r in reqs:
            hashes = tuple(h + id_offset for h in r.hash_ids)
            top = max(top, *hashes) if hashes else top
            out.append((k, replace(r, index=len(out), arrival_s=t0 + r.arrival_s, hash_ids=hashes)))
        t0 += ph.duration_s
        id_offset = top + 1
    return out


# ---------------------------------------------------------------- driving
async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """True once ``stop`` is set, False after ``seconds`` without it."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def send_at(
    arrival_s: float, t0: float, tasks: set[asyncio.Task[None]], run: PhaseRun
) -> bool:
    """Sleep until ``arrival_s`` (seconds after ``t0``); False, the run marked cut short, when
    ``MAX_PENDING`` client requests are open already."""
    delay = arrival_s - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    if len(tasks) >= MAX_PENDING:
        run.cut_short = True
        return False
    return True


async def finish_or_cancel(tasks: set[asyncio.Task[None]], timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the open client requests; cancel the rest."""
    if tasks:
        _, late = await asyncio.wait(set(tasks), timeout=timeout_s)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)


async def _timed(
    session: aiohttp.ClientSession,
    tr: TraceRequest,
    opts: LoadOptions,
    t0: float,
    out: RequestOutcome,
    reject_ms: list[float],
    encode: Callable[[TraceRequest], list[int]],
) -> None:
    ids = encode(tr)
    sent = time.perf_counter()
    await send_one(session, tr, ids, opts, t0, out)
    if out.outcome is Outcome.REJECTED:
        reject_ms.append((time.perf_counter() - sent) * 1e3)


async def _sampler(
    fleet: EmulatedFleet,
    run: PhaseRun,
    tasks: set[asyncio.Task[None]],
    every_s: float,
    t0: float,
    stop: asyncio.Event,
    n: int,
) -> None:
    for _ in range(n):  # bounded: n samples at most
        try:
            books = (await asyncio.to_thread(fleet.books)).as_dict()
        except (OSError, ValueError, KeyError):  # a stalled or starting gateway: no books
            books = None
        run.samples.append(
            Sample(
                time.perf_counter() - t0,
                fleet.gateway_rss_kb(),
                fleet.gateway_cpu_s(),
                os.getloadavg()[0],
                books,
                len(tasks),
            )
        )
        if await _stopped_within(stop, every_s):
            return


async def _pinger(
    fleet: EmulatedFleet, run: PhaseRun, every_s: float, t0: float, stop: asyncio.Event, n: int
) -> None:
    targets = {"gateway": fleet.url, "engine": next(iter(fleet.engine_urls.values()))}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for _ in range(n):  # bounded: n rounds at most
            for name, url in targets.items():
                sent = time.perf_counter()
                try:
                    async with session.get(url + "/health") as resp:
                        await resp.read()
                except (TimeoutError, aiohttp.ClientError):
                    continue
                done = time.perf_counter()
                run.pings.append((sent - t0, name, (done - sent) * 1e3))
            if await _stopped_within(stop, every_s):
                return


async def drive(
    fleet: EmulatedFleet,
    phases: list[Phase],
    args: argparse.Namespace,
    sample_s: float | None = None,
    probe_every_ms: float | None = None,
    encode: Callable[[TraceRequest], list[int]] | None = None,
    model: str | None = None,
) -> PhaseRun:
    """Open-loop load through ``phases``; samples RSS and books every ``sample_s`` if given;
    with ``probe_every_ms``, the rejection probe runs alongside the load. ``encode`` turns a
    request into its prompt's token ids (default: ``prompt_ids`` with a fresh block cache each,
    as a long run must not keep every prompt); ``model`` is the requests' model field."""
    trace = phase_trace(phases, args.input_tokens, args.output_tokens, args.seed)
    encode = encode or (lambda tr: prompt_ids(tr, {}))
    opts = LoadOptions(
        fleet.url,
        1.0,
        model=model,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        timeout_s=max(60.0, 10 * args.ttft_slo),
    )
    run = PhaseRun(phases, [[] for _ in phases], [[] for _ in phases])
    total_s = sum(p.duration_s for p in phases)
    stop = asyncio.Event()
    t0, t0_epoch = time.perf_counter(), time.time()
    probe_out, probe = fleet.spec.workdir / "reject-probe.json", None
    if probe_every_ms:
        probe = start_live_probe(fleet.url, probe_out, total_s, probe_every_ms)
    sampler = None
    tasks: set[asyncio.Task[None]] = set()  # open client requests
    n_pings = int((total_s + DRAIN_S) / PING_S) + 2
    pinger = asyncio.create_task(_pinger(fleet, run, PING_S, t0, stop, n_pings))
    if sample_s:
        n = int((total_s + DRAIN_S) / sample_s) + 2
        sampler = asyncio.create_task(_sampler(fleet, run, tasks, sample_s, t0, stop, n))
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            for k, tr in trace:
                if not await send_at(tr.arrival_s, t0, tasks, run):
                    break
                out = RequestOutcome(
                    f"r{tr.index}", tr.arrival_s, tr.input_length, tr.output_length
                )
                run.outcomes[k].append(out)
                coro = _timed(session, tr, opts, t0, out, run.reject_ms[k], encode)
                task = asyncio.create_task(coro)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await finish_or_cancel(tasks, DRAIN_S + opts.timeout_s)
    except BaseException:  # Ctrl-C, SIGTERM: the probe child is ended by its PID too
        if probe is not None and probe.poll() is None:
            probe.kill()
            probe.wait()
        raise
    stop.set()
    await pinger
    if sampler is not None:
        await sampler
    if probe is not None:
        starts = [sum(p.duration_s for p in phases[:k]) for k in range(len(phases))]
        for row in await asyncio.to_thread(live_probe_rows, probe, probe_out):
            t = row[0] - t0_epoch
            k = max((k for k, s in enumerate(starts) if t >= s), default=0)
            run.probe[k].append(row)
    return run
