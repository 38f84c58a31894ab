"""Llama-3-8B step times on one GPU, run the way a serving engine runs a step.

``bench/gpu_step_times.py`` timed Hugging Face transformers in eager mode: its decode is bound by
Python launching ~1,000 kernels per step, and its prefix prefill goes through ``repeat_kv`` and an
explicit mask. No vLLM can be installed on the GPU machine, so this module writes the forward
itself the way engines do (stdlib + torch only; no kvgate imports, like its sibling):

- fused QKV and gate/up projections (one GEMM each, as vLLM's ``QKVParallelLinear`` and
  ``MergedColumnParallelLinear``), logits for the last position only;
- KV written in place into a preallocated per-sequence cache (no re-copy per step);
- GQA-native attention: prefill through PyTorch SDPA with a bottom-right causal bias
  (``causal_lower_right``, so the new tokens see the whole cached prefix) and ``enable_gqa``;
  decode as one grouped batched matmul per layer that reads K and V once;
- each step captured once as a CUDA graph and replayed (vLLM captures decode steps).

Per point: ``median_ms`` is the CUDA-graph replay (what an engine's step costs end to end without
launch gaps), ``eager_ms`` the same forward launched from Python, ``gpu_kernel_ms`` the sum of its
GPU kernel durations (one ``torch.profiler`` pass) and ``top_kernels`` which kernels ran: the
attention kernel's name says which SDPA backend PyTorch chose. What stays unlike vLLM: RMSNorm,
RoPE, SiLU-and-mul and residual adds are PyTorch's separate elementwise kernels (vLLM fuses
them), and the cache is contiguous per sequence, not paged.

    python3 -m bench.gpu_engine_steps --out $OUT/engine-steps.json
    python3 -m bench.gpu_engine_steps --tiny --device cpu --out /tmp/e.json   # smoke test
    .venv/bin/python -m bench.compare_gpu_profile --steps docs/data/gpu-engine-steps.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from bench.gpu_attention import KERNELS, Shape, reference_attention
from bench.gpu_points import DECODE_POINTS, LLAMA3_8B, PREFILL_N, PREFILL_PREFIX, TINY
from bench.gpu_timing import Timer, bench_device, bench_parser, kernel_profile, sanity, write_json

DECODE_LARGE = ((128, 2048), (256, 512))  # batches only a graph-captured engine runs cheaply

KV = list[tuple[torch.Tensor, torch.Tensor]]
MAX_ABS_ERROR = 0.05  # bf16 attention against the float reference


@dataclass(frozen=True, slots=True)
class Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # (heads + 2 * kv_heads) * head_dim x hidden: one GEMM
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # 2 * intermediate x hidden: one GEMM
    down: torch.Tensor


class EngineLlama:
    """The Llama forward with an engine's fusions; random bf16 weights (values do not change
    dense kernels' speed)."""

    def __init__(self, shape: Shape, device: torch.device, max_positions: int) -> None:
        self.s, self.device, self.dtype = shape, device, torch.bfloat16
        # the KERNELS entry per step kind; each point picks its own by timing
        self.kernel = {"prefill": "sdpa", "decode": "sdpa_gqa"}
        torch.manual_seed(0)

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=self.dtype) * (cols**-0.5)

        def ones() -> torch.Tensor:
            return torch.ones(shape.hidden, device=device, dtype=self.dtype)

        qkv_rows = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        self.layers = [
            Layer(
                ones(),
                w(qkv_rows, shape.hidden),
                w(shape.hidden, shape.hidden),
                ones(),
                w(2 * shape.intermediate, shape.hidden),
                w(shape.hidden, shape.intermediate),
            )
            for _ in range(shape.layers)
        ]
        self.embed = w(shape.vocab, shape.hidden)
        self.final_norm = ones()
        self.lm_head = w(shape.vocab, shape.hidden)
        half = shape.head_dim // 2
        inv_freq = shape.rope_theta ** (-torch.arange(half, device=device).float() / half)
        angles = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
        self.cos = angles.cos().to(self.dtype)  # (positions, head_dim / 2)
        self.sin = angles.sin().to(self.dtype)

    def new_cache(self, batch: int, length: int) -> KV:
        """Random K/V for every position (a cached prefix's values do not change the speed)."""
        size = (batch, self.s.kv_heads, length, self.s.head_dim)
        return [
            (
                torch.randn(size, device=self.device, dtype=self.dtype),
                torch.randn(size, device=self.device, dtype=self.dtype),
            )
            for _ in self.layers
        ]

    def rope(self, x: torch.Tensor, start: int) -> torch.Tensor:
        n = x.shape[1]  # x: (B, n, heads, head_dim), neox-style halves as Llama's HF weights
        cos = self.cos[start : start + n].view(1, n, 1, -1)
        sin = self.sin[start : start + n].view(1, n, 1, -1)
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, heads, n, d); k, v (B, kv_heads, total, d), the last n positions new."""
        kind = "decode" if q.shape[2] == 1 else "prefill"
        return KERNELS[kind][self.kernel[kind]](self.s, q, k, v)

    def forward(self, ids: torch.Tensor, start: int, cache: KV) -> torch.Tensor:
        """Logits of the last position; writes the n new tokens' K/V at ``start`` in place."""
        s = self.s
        batch, n = ids.shape
        x = F.embedding(ids, self.embed)
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer, (k_cache, v_cache) in zip(self.layers, cache, strict=True):
            h = F.rms_norm(x, (s.hidden,), layer.ln1, 1e-5)
            q, k, v = F.linear(h, layer.qkv).split((q_size, kv_size, kv_size), dim=-1)
            q = self.rope(q.view(batch, n, s.heads, s.head_dim), start)
            k = self.rope(k.view(batch, n, s.kv_heads, s.head_dim), start)
            k_cache[:, :, start : start + n].copy_(k.transpose(1, 2))
            v_cache[:, :, start : start + n].copy_(v.view(batch, n, s.kv_heads, -1).transpose(1, 2))
            end = start + n
            out = self.attention(q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end])
            x = x + F.linear(out.transpose(1, 2).reshape(batch, n, q_size), layer.o)
            h = F.rms_norm(x, (s.hidden,), layer.ln2, 1e-5)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        last = F.rms_norm(x[:, -1], (s.hidden,), self.final_norm, 1e-5)
        return F.linear(last, self.lm_head)


def check_attention(model: EngineLlama) -> dict[str, float]:
    """Max abs error of every attention kernel against ``reference_attention`` on small cases,
    so that a fast but wrong kernel path cannot pass unnoticed. A kernel this torch or GPU
    lacks is left out (never picked later)."""
    s, out = model.s, {}
    cases = {"prefill": (24, 24), "prefix": (16, 48), "decode": (1, 40)}
    for name, (n, total) in cases.items():
        q = torch.randn(2, s.heads, n, s.head_dim, device=model.device, dtype=model.dtype)
        k = torch.randn(2, s.kv_heads, total, s.head_dim, device=model.device, dtype=model.dtype)
        v = torch.randn_like(k)
        want = reference_attention(q, k, v)
        for kernel, fn in KERNELS["decode" if n == 1 else "prefill"].items():
            try:
                got = fn(s, q, k, v).float()
            except RuntimeError as exc:
                print(f"{name} kernel {kernel} unavailable: {str(exc)[:200]}", flush=True)
                continue
            out[f"{name}:{kernel}"] = float((got - want).abs().max())
    return out


def usable_kernels(checks: dict[str, float]) -> dict[str, list[str]]:
    """Per step kind, the kernels that ran every case of that kind and matched the reference."""
    by_case: dict[str, set[str]] = {}
    for key, err in checks.items():
        case, kernel = key.split(":")
        if err <= MAX_ABS_ERROR:
            by_case.setdefault(case, set()).add(kernel)
    prefill = by_case.get("prefill", set()) & by_case.get("prefix", set())
    return {"prefill": sorted(prefill), "decode": sorted(by_case.get("decode", set()))}


@dataclass
class Point:
    """One step's shape, then its times (filled in by ``Bench.timed``)."""

    kind: str  # "prefill" | "decode" | "mixed"
    new_tokens: int
    cached_tokens: int  # per sequence
    batch: int
    median_ms: float | None = None  # CUDA-graph replay (None where capture failed: graph_error)
    graph_samples_ms: list[float] = field(default_factory=list)
    eager_ms: float = 0.0
    eager_samples_ms: list[float] = field(default_factory=list)
    gpu_kernel_ms: float | None = None
    top_kernels: list[Any] = field(default_factory=list)
    graph_error: str | None = None
    attention_kernel: str | None = None  # the KERNELS entry this point ran
    attention_kernel_ms: dict[str, float] | None = None  # one layer's attention, each kernel
    # "mixed" points (bench/gpu_mixed_steps.py): the decoding sequences that share the step
    # with the prefill chunk (new_tokens behind cached_tokens), and the context of each
    decode_batch: int = 0
    decode_context: int = 0


class Bench:
    def __init__(self, model: EngineLlama, warmup: int, reps: int) -> None:
        self.model, self.warmup, self.reps = model, warmup, reps
        self.timer = Timer(model.device)

    def samples(self, fn: Callable[[], Any]) -> list[float]:
        return self.timer.samples(fn, self.warmup, self.reps)

    def graph(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on a side stream, as torch.cuda.graphs asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def pick_kernel(self, kind: str, new: int, k: torch.Tensor, v: torch.Tensor, usable: list[str]):
        """Time one layer's attention at this point's shape with each usable kernel; the model
        takes the fastest. Returns {kernel: median ms}."""
        m, batch = self.model, k.shape[0]
        q = torch.randn(batch, m.s.heads, new, m.s.head_dim, device=m.device, dtype=m.dtype)
        times = {}
        for name in usable:
            kernel = KERNELS[kind][name]
            times[name] = statistics.median(self.samples(lambda: kernel(m.s, q, k, v)))  # noqa: B023
        m.kernel[kind] = min(times, key=times.__getitem__)
        return times

    def point(self, kind: str, batch: int, new: int, cached: int, usable: list[str]) -> Point:
        m = self.model
        ids = torch.randint(0, m.s.vocab, (batch, new), device=m.device)
        cache = m.new_cache(batch, cached + new)
        with torch.inference_mode():
            picked = self.pick_kernel(kind, new, *cache[0], usable)

        def step() -> torch.Tensor:
            return m.forward(ids, cached, cache)

        return self.timed(
            Point(kind, new, cached, batch, None, [], 0.0, [], None, []), step, picked
        )

    def timed(self, pt: Point, step: Callable[[], Any], picked: dict[str, float]) -> Point:
        """``pt`` (its shape filled in) with ``step``'s times: eager, kernels, graph replay."""
        m = self.model
        with torch.inference_mode():
            eager = self.samples(step)
            profiled = kernel_profile(step, m.device)
            if m.device.type == "cuda":
                try:
                    pt.graph_samples_ms = self.samples(self.graph(step))
                except Exception as exc:  # keep the eager numbers of a shape that will not capture
                    pt.graph_error = repr(exc)[:300]
        if pt.graph_samples_ms:
            pt.median_ms = statistics.median(pt.graph_samples_ms)
        pt.eager_ms, pt.eager_samples_ms = statistics.median(eager), eager
        if profiled is not None:
            pt.gpu_kernel_ms, pt.top_kernels = profiled
        kind = "decode" if pt.kind == "decode" else "prefill"
        pt.attention_kernel = m.kernel[kind]
        if pt.kind == "mixed":
            pt.attention_kernel = f"{m.kernel['prefill']}+{m.kernel['decode']}"
        pt.attention_kernel_ms = picked
        return pt


def checked_model(
    shape: Shape, device: torch.device
) -> tuple[EngineLlama, dict[str, float], dict[str, list[str]]] | None:
    """The model, its attention kernels' errors and the usable ones; None (reason printed)
    when no kernel of a step kind matches the reference."""
    model = EngineLlama(shape, device, max_positions=20000)
    with torch.inference_mode():
        checks = check_attention(model)
    print(f"attention max abs error vs reference: {checks}", flush=True)
    usable = usable_kernels(checks)
    if not usable["prefill"] or not usable["decode"]:
        print(f"error: no attention kernel matched the reference: {checks}", file=sys.stderr)
        return None
    return model, checks, usable


def plan(tiny: bool) -> list[tuple[str, int, int, int]]:
    """(kind, batch, new tokens, cached tokens) of every point, small first."""
    if tiny:
        return [("prefill", 1, 64, 0), ("prefill", 1, 32, 64), ("decode", 4, 1, 128)]
    pre = [("prefill", 1, n, 0) for n in PREFILL_N]
    pre += [("prefill", 1, n, c) for n, c in PREFILL_PREFIX]
    return pre + [("decode", b, 1, k) for b, k in DECODE_POINTS + DECODE_LARGE]


def meta(model: EngineLlama, args: argparse.Namespace, checks: dict[str, float]) -> dict:
    device = model.device
    out: dict[str, Any] = {
        "script": "bench/gpu_engine_steps.py",
        "e2e_label": "graph",  # what median_ms is: compare_gpu_profile labels its column so
        "model_shape": "tiny" if args.tiny else "llama3-8b",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "warmup": args.warmup,
        "reps": args.reps,
        "attention_max_abs_error": checks,
        "card": sanity(device, args.tiny),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out |= {"gpu": props.name, "sms": props.multi_processor_count}
    return out


def main(argv: list[str] | None = None) -> int:
    args = bench_parser("python3 -m bench.gpu_engine_steps", __doc__).parse_args(argv)
    device = bench_device(args.device)
    if device is None:
        return 2
    shape = Shape.from_hf(TINY if args.tiny else LLAMA3_8B)
    t0 = time.perf_counter()
    found = checked_model(shape, device)
    if found is None:
        return 1
    model, checks, usable = found
    bench, points = Bench(model, args.warmup, args.reps), []
    todo = plan(args.tiny)
    for i, (kind, batch, new, cached) in enumerate(todo, 1):
        pt = bench.point(kind, batch, new, cached, usable[kind])
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the point's cache and graph pool are gone with it
        points.append(pt)
        graph = "-" if pt.median_ms is None else f"{pt.median_ms:.2f}"
        kernels = "-" if pt.gpu_kernel_ms is None else f"{pt.gpu_kernel_ms:.2f}"
        kernel = f" [{pt.attention_kernel}]"
        print(
            f"[{i}/{len(todo)}] {kind} B={batch} n={new} cached={cached}{kernel}: "
            f"graph {graph} ms, "
            f"eager {pt.eager_ms:.2f} ms, kernels {kernels} ms ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    data = {"meta": meta(model, args, checks), "points": [asdict(x) for x in points]}
    data["meta"]["script_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
