"""`kvgate bench decision`: latency of one full scheduling decision on a warmed state.

The state is built to look like a busy fleet: every prefill instance holds prefixes of
shared system prompts and conversation histories up to its KV capacity, has prefills queued,
and every decode instance runs a batch. Each measured call is ``Conductor.schedule`` with
kvcache_centric placement, predictive admission and replication planning on.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace

from config.admission_settings import DecodeReservationSettings
from config.settings import (
    AdmissionMode,
    AdmissionSettings,
    InstanceSettings,
    PoolSettings,
    Role,
    RoutingSettings,
    Settings,
    SLOSettings,
)
from routing.conductor import Conductor
from routing.types import BlockStored, Decision, RequestInfo


@dataclass(frozen=True, slots=True)
class BenchResult:
    instances: int
    prompt_blocks: int
    requests: int
    p50_us: float
    p90_us: float
    p99_us: float
    mean_us: float
    max_us: float
    admitted: int
    rejected: int

    def as_dict(self) -> dict[str, float | int | str]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["policy"] = "kvcache_centric"
        d["admission"] = "predictive"
        return d


def build_settings(instances: int, block_size: int = 16, reservation: bool = True) -> Settings:
    def pool(name: str, role: Role, port: int) -> PoolSettings:
        return PoolSettings(
            name=name,
            role=role,
            instances=tuple(
                InstanceSettings(id=f"{name}-{i}", url=f"http://127.0.0.1:{port + i}", role=role)
                for i in range(instances)
            ),
        )

    return Settings(
        slo=SLOSettings(ttft_s=30.0, tbt_s=0.1),
        routing=RoutingSettings(policy="kvcache_centric", block_size=block_size),
        admission=AdmissionSettings(
            mode=AdmissionMode.PREDICTIVE,
            decode_reservation=DecodeReservationSettings(enabled=reservation),
        ),
        pools=(pool("prefill", Role.PREFILL, 9000), pool("decode", Role.DECODE, 12000)),
    )


class _Workload:
    """Prompts made of a shared system prompt, a conversation history and fresh tokens."""

    def __init__(self, rng: random.Random, prompt_blocks: int, block_size: int) -> None:
        self.rng = rng
        self.prompt_blocks = prompt_blocks
        self.block_size = block_size
        self.systems = [
            tuple(rng.getrandbits(63) for _ in range(max(prompt_blocks // 4, 1))) for _ in range(32)
        ]
        self.histories = [
            self.systems[i % 32]
            + tuple(rng.getrandbits(63) for _ in range(max(prompt_blocks // 2, 1)))
            for i in range(256)
        ]
        self.seq = 0

    def request(self, now: float) -> RequestInfo:
        rng = self.rng
        base = self.histories[rng.randrange(len(self.histories))]
        keep = rng.randint(len(base) // 3, len(base))
        fresh = tuple(rng.getrandbits(63) for _ in range(max(self.prompt_blocks - keep, 0)))
        hashes = (base[:keep] + fresh)[: self.prompt_blocks]
        self.seq += 1
        return RequestInfo(
            request_id=f"r{self.seq}",
            prompt_tokens=len(hashes) * self.block_size,
            block_hashes=hashes,
            max_tokens=512,
            arrival_s=now,
            output_key=hashes[0],
        )


def warm(conductor: Conductor, work: _Workload, rng: random.Random) -> float:
    """Fill caches, queues and decode batches; returns the clock after warm-up."""
    now = 0.0
    prefill = [i for i in conductor.instances.values() if i.role is Role.PREFILL]
    for inst in prefill:
        # Each instance caches a random third of the conversation histories plus filler blocks.
        for h in rng.sample(work.histories, len(work.histories) // 3):
            conductor.kv_event(inst.id, BlockStored(h), now)
        filler = tuple(rng.getrandbits(63) for _ in range(10_000))
        conductor.kv_event(inst.id, BlockStored(filler), now)
    for _ in range(len(work.histories)):
        conductor.output_lengths.observe(rng.choice(work.histories)[0], rng.randint(50, 800))
    # Keep the queue realistic: dispatch until every prefill instance has work queued and
    # every decode instance a batch, completing prefills as time moves on.
    target = 48 * len(prefill)
    dispatched: list[str] = []
    while len(dispatched) < target:
        now += 0.002
        req = work.request(now)
        out = conductor.schedule(req, now)
        if isinstance(out, Decision):
            conductor.dispatched(out, req, now)
            dispatched.append(req.request_id)
    # Half of them finished their prefill and decode now; a few tokens each.
    for rid in dispatched[: len(dispatched) * 3 // 4]:
        conductor.prefill_done(rid, now)
        conductor.tokens(rid, rng.randint(1, 200), now)
    return now


def run(
    instances: int,
    prompt_blocks: int,
    requests: int = 2000,
    seed: int = 0,
    reservation: bool = True,
) -> BenchResult:
    rng = random.Random(seed)
    settings = build_settings(instances, reservation=reservation)
    # Admit everything during warm-up so the state is as loaded as asked.
    conductor = Conductor(replace(settings, admission=AdmissionSettings(mode=AdmissionMode.NONE)))
    work = _Workload(rng, prompt_blocks, settings.routing.block_size)
    now = warm(conductor, work, rng)
    conductor.apply_settings(settings)
    samples: list[float] = []
    admitted = 0
    reqs = [work.request(now) for _ in range(requests)]
    clock = time.perf_counter_ns
    for req in reqs:
        t0 = clock()
        out = conductor.schedule(req, now)
        samples.append((clock() - t0) / 1000.0)
        admitted += isinstance(out, Decision)
    samples.sort()
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return BenchResult(
        instances=instances,
        prompt_blocks=prompt_blocks,
        requests=requests,
        p50_us=round(q[49], 2),
        p90_us=round(q[89], 2),
        p99_us=round(q[98], 2),
        mean_us=round(statistics.fmean(samples), 2),
        max_us=round(samples[-1], 2),
        admitted=admitted,
        rejected=requests - admitted,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--instances",
        type=int,
        default=16,
        help="prefill instances (and as many decode instances); default 16",
    )
    parser.add_argument(
        "--prompt-blocks",
        type=int,
        default=64,
        help="blocks per prompt (16 tokens each); default 64",
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="measured decisions; default 2000"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="run N in {8,16,64} x B in {16,64,256}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--decode-reservation",
        choices=["on", "off"],
        default="on",
        help="admission.decode_reservation (default on, as served); off shows its cost",
    )
    parser.add_argument("--json", action="store_true", help="print JSON only")


def main(args: argparse.Namespace) -> int:
    for name in ("instances", "prompt_blocks", "requests"):
        if getattr(args, name) < 1:
            print(
                f"kvgate bench decision: --{name.replace('_', '-')} must be >= 1", file=sys.stderr
            )
            return 2
    grid = (
        [(n, b) for n in (8, 16, 64) for b in (16, 64, 256)]
        if args.sweep
        else [(args.instances, args.prompt_blocks)]
    )
    results = []
    for n, b in grid:
        res = run(n, b, args.requests, args.seed, args.decode_reservation == "on")
        results.append(res.as_dict())
        if not args.json:
            print(
                f"N={n:<3} B={b:<4} p50={res.p50_us:8.1f} us  p99={res.p99_us:8.1f} us  "
                f"mean={res.mean_us:8.1f} us  admitted={res.admitted}/{res.requests}",
                file=sys.stderr,
            )
    print(json.dumps(results[0] if len(results) == 1 else results))
    return 0
