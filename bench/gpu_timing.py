"""Timing tools for the GPU benches (bench/gpu_step_times.py, bench/gpu_engine_steps.py):
CUDA-event timing (perf_counter on CPU), the GPU kernel time of one call from one
``torch.profiler`` pass, the card's matmul and copy ceilings, and a probe of whether
transformers' SDPA path used native GQA (transformers is imported only there). Stdlib + torch,
like its callers: they run on a GPU machine without kvgate installed."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def bench_parser(
    prog: str, doc: str | None, *, warmup: int = 3, reps: int = 9, tiny: str = "tiny shape"
) -> argparse.ArgumentParser:
    """The options every GPU bench takes: where to write, on which device, how many repeats."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"{tiny} (smoke test, CPU is fine)")
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--reps", type=int, default=reps)
    return p


def bench_device(name: str) -> torch.device | None:
    """The device asked for; None, with the reason printed, if it is CUDA and there is none."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (use --device cpu --tiny for a smoke test)", file=sys.stderr)
        return None
    return device


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


class Timer:
    """Device-event timing on CUDA, perf_counter on CPU (smoke tests only)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(stream time ms, host issue time ms) of one call; the caller synced before."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host = (time.perf_counter() - t0) * 1000.0
            end.record()
            end.synchronize()
            return start.elapsed_time(end), host
        t0 = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - t0) * 1000.0
        return elapsed, elapsed

    def samples(self, fn: Callable[[], Any], warmup: int, reps: int) -> list[float]:
        """Stream times (ms) of ``reps`` calls after ``warmup`` untimed ones, each synced."""
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            self.sync()
            out.append(self.once(fn)[0])
        return out


class GqaProbe:
    """Records whether transformers' SDPA path used native GQA (no mask) on the last forward.

    Wraps ``use_gqa_in_sdpa`` where this transformers version has it; otherwise reports None."""

    def __init__(self) -> None:
        self.seen: set[bool] = set()
        try:
            from transformers.integrations import sdpa_attention as sdpa
        except ImportError:
            self._ok = False
            return
        original = getattr(sdpa, "use_gqa_in_sdpa", None)
        self._ok = original is not None
        if original is None:
            return

        def wrapped(*args: Any, **kwargs: Any) -> bool:
            result = bool(original(*args, **kwargs))
            self.seen.add(result)
            return result

        sdpa.use_gqa_in_sdpa = wrapped

    def reset(self) -> None:
        self.seen.clear()

    def result(self) -> bool | None:
        if not self._ok or len(self.seen) != 1:
            return None
        return next(iter(self.seen))


def kernel_profile(fn: Callable[[], Any], device: torch.device) -> tuple[float, list[Any]] | None:
    """(sum of GPU kernel/memcpy durations in ms, top kernels [name, ms, count]) of one call.
    Kernels run back to back on one stream, so the sum is the GPU-busy time."""
    if device.type != "cuda":
        return None
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        by_name: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                by_name.setdefault(e.name, []).append(e.self_device_time_total / 1000.0)
        total = sum(sum(v) for v in by_name.values())
        top = sorted(
            ([k[:120], round(sum(v), 3), len(v)] for k, v in by_name.items()),
            key=lambda row: -row[1],
        )[:8]
        return total, top
    except Exception as exc:  # the profiler is a diagnostic: never lose the timings over it
        print(f"profiler failed: {exc!r}", file=sys.stderr)
        return None


def kernel_ms(fn: Callable[[], Any], device: torch.device) -> float | None:
    found = kernel_profile(fn, device)
    return None if found is None else found[0]


def sanity(device: torch.device, tiny: bool) -> dict[str, float]:
    """The card's two ceilings as found: a bf16 matmul and a device-to-device copy."""
    if device.type != "cuda":
        return {}
    timer = Timer(device)
    size = 1024 if tiny else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    src = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    mm = statistics.median(timer.samples(lambda: a @ b, warmup=3, reps=10))
    cp = statistics.median(timer.samples(lambda: dst.copy_(src), warmup=3, reps=10))
    return {
        "matmul_bf16_tflops": 2 * size**3 / (mm / 1000.0) / 1e12,
        "copy_tb_per_s_read_plus_write": 2 * src.numel() * 2 / (cp / 1000.0) / 1e12,
    }
