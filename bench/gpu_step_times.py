"""Real Llama-3-8B-shaped step times on one GPU, with plain PyTorch + transformers.

Runs ON a GPU machine (stdlib + torch + transformers only; no kvgate imports) and writes JSON
that ``bench/compare_gpu_profile.py`` compares with kvgate's ``llama3-8b-h100-tp1`` profile.

The model is a randomly initialised ``LlamaForCausalLM`` with the Llama-3-8B shape in bf16 and
``attn_implementation="sdpa"``; weights' values do not change dense kernels' speed. Logits are
computed for the last position only (``logits_to_keep=1``), as serving engines do.

Measured per point (CUDA events around one forward, after warm-ups, median of the repeats):
- prefill of n new tokens, alone or behind a cached prefix of c tokens (a ``DynamicCache`` filled
  by a previous forward and copied fresh before every repeat, outside the timed region);
- decode: one-token steps for a batch of B sequences each holding K tokens of KV cache (random
  K/V, since their values do not change attention's speed).
Besides the event time ("wall" of the GPU stream, including gaps while Python launches kernels)
each point records the host time to issue the forward, and the sum of its GPU kernel durations
from one ``torch.profiler`` pass: the GPU-only time that kvgate's profiles model. Decode points
also time DynamicCache's per-step ``torch.cat`` re-copy of the cache apart (a paged engine
writes the new token in place). Last, after every eager number is saved, each step is replayed
as a CUDA graph (a diagnostic: see ``Bench.graph_ms``).

    python3 -m bench.gpu_step_times --out $OUT/steps.json
    python3 -m bench.gpu_step_times --tiny --device cpu --out /tmp/steps.json   # smoke test

(from the repo root; the timing tools are in bench/gpu_timing.py)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from bench.gpu_points import DECODE_POINTS, LLAMA3_8B, PREFILL_N, PREFILL_PREFIX, TINY
from bench.gpu_timing import GqaProbe, Timer, kernel_ms, kernel_profile, sanity


@dataclass
class Point:
    kind: str  # "prefill" | "decode"
    new_tokens: int
    cached_tokens: int  # per sequence
    batch: int
    samples_ms: list[float]
    host_issue_ms: list[float]
    gpu_kernel_ms: float | None
    gqa_native: bool | None  # SDPA ran with enable_gqa (no mask); False = repeat_kv + mask
    kv_append_ms: float | None = None  # decode: DynamicCache's torch.cat re-copy, timed apart
    kv_append_kernel_ms: float | None = None  # the same, GPU kernel time only
    graph_ms: float | None = None  # the step replayed as a CUDA graph (no launch gaps)
    graph_error: str | None = None
    median_ms: float = field(init=False)
    min_ms: float = field(init=False)
    max_ms: float = field(init=False)

    def __post_init__(self) -> None:
        self.median_ms = statistics.median(self.samples_ms)
        self.min_ms = min(self.samples_ms)
        self.max_ms = max(self.samples_ms)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.dtype = torch.bfloat16
        self.warmup, self.reps = args.warmup, args.reps
        self.timer = Timer(self.device)
        self.probe = GqaProbe()
        shape = TINY if args.tiny else LLAMA3_8B
        config = LlamaConfig(**shape)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(config).eval()
        torch.set_default_dtype(previous)
        self.config = config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.layers = config.num_hidden_layers

    def tokens(self, batch: int, n: int) -> torch.Tensor:
        return torch.randint(0, self.config.vocab_size, (batch, n), device=self.device)

    def forward(self, ids: torch.Tensor, cache: DynamicCache | None) -> Any:
        return self.model(
            input_ids=ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1
        )

    def cache_from(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        return cache

    def measure(
        self, kind: str, n: int, c: int, batch: int, make_call: Callable[[], Callable[[], Any]]
    ) -> Point:
        """``make_call`` builds a fresh call (inputs, cache) outside the timed region."""
        with torch.inference_mode():
            call: Callable[[], Any] | None = None
            for _ in range(self.warmup):
                call = None  # drop the previous cache before building the next one
                call = make_call()
                self.timer.sync()
                call()
            samples, hosts = [], []
            self.probe.reset()
            for _ in range(self.reps):
                call = None
                call = make_call()
                self.timer.sync()
                ms, host = self.timer.once(call)
                samples.append(ms)
                hosts.append(host)
            gqa = self.probe.result()
            call = None
            gpu = kernel_ms(make_call(), self.device)
        return Point(kind, n, c, batch, samples, hosts, gpu, gqa)

    def prefill_calls(self, n: int, cached: int) -> Callable[[], Callable[[], Any]]:
        prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if cached:
            with torch.inference_mode():
                cache = DynamicCache()
                self.model(
                    input_ids=self.tokens(1, cached),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                prefix_kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
                del cache

        def make_call() -> Callable[[], Any]:
            ids = self.tokens(1, n)
            cache = self.cache_from(prefix_kv) if cached else None
            return lambda: self.forward(ids, cache)

        return make_call

    def decode_calls(self, batch: int, ctx: int) -> Callable[[], Callable[[], Any]]:
        shape = (batch, self.kv_heads, ctx, self.head_dim)
        with torch.inference_mode():
            # One random K and V shared by all layers: a fresh cache copies them (outside timing).
            k = torch.randn(shape, device=self.device, dtype=self.dtype)
            v = torch.randn(shape, device=self.device, dtype=self.dtype)

        def make_call() -> Callable[[], Any]:
            ids = self.tokens(batch, 1)
            cache = self.cache_from([(k, v)] * self.layers)
            return lambda: self.forward(ids, cache)

        return make_call

    def prefill(self, n: int, cached: int) -> Point:
        return self.measure("prefill", n, cached, 1, self.prefill_calls(n, cached))

    def decode(self, batch: int, ctx: int) -> Point:
        point = self.measure("decode", 1, ctx, batch, self.decode_calls(batch, ctx))
        point.kv_append_ms, point.kv_append_kernel_ms = self.kv_append(batch, ctx)
        return point

    def kv_append(self, batch: int, ctx: int) -> tuple[float, float | None]:
        """What DynamicCache's per-step ``torch.cat`` costs at this shape over all layers (stream
        time, kernel time): a paged engine writes the one new token in place instead."""
        shape = (batch, self.kv_heads, ctx, self.head_dim)
        k = torch.randn(shape, device=self.device, dtype=self.dtype)
        v = torch.randn(shape, device=self.device, dtype=self.dtype)
        new = k[:, :, :1].clone()

        def appends() -> None:
            for _ in range(self.layers):
                torch.cat([k, new], dim=-2)
                torch.cat([v, new], dim=-2)

        with torch.inference_mode():
            runs = self.timer.samples(appends, self.warmup, self.reps)
            kernels = kernel_ms(appends, self.device)
        return statistics.median(runs), kernels

    def graph_ms(
        self,
        make_call: Callable[[], Callable[[], Any]],
        *,
        no_math: bool = True,
        diagnose: bool = False,
    ) -> tuple[float, Any]:
        """Median replay time of one step captured as a CUDA graph: the step with the Python
        launch gaps removed (what vLLM's CUDA graphs do for decode). Replays redo the same
        step on the same cache, so the cache does not grow. ``no_math`` allows only SDPA's
        flash and mem-efficient kernels during capture. Seen on an H100 with torch 2.11: under
        capture SDPA copies the GQA K/V out to all 32 heads and runs a slower attention kernel
        whichever backends are allowed, so replays are SLOWER than the eager kernel sum and are
        kept as a diagnostic only (docs/gpu-step-times.md). With ``diagnose``, also returns the
        top kernels of one replay."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if not no_math:
            allowed += [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
        with torch.inference_mode(), sdpa_kernel(allowed):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    make_call()()
            torch.cuda.current_stream().wait_stream(side)
            call = make_call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            runs = self.timer.samples(graph.replay, self.warmup, self.reps)
            top = kernel_profile(graph.replay, self.device) if diagnose else None
            del graph, call
        return statistics.median(runs), top


def diagnose_graphs(bench: Bench) -> list[dict[str, Any]]:
    """Top kernels of eager vs graph replay (default SDPA choice vs no math fallback) for two
    points, to explain any gap between a replay and the eager kernel sum."""
    out = []
    for kind, a, b in (("decode", 32, 2048), ("prefill", 4096, 0)):
        calls = bench.decode_calls(a, b) if kind == "decode" else bench.prefill_calls(a, b)
        row: dict[str, Any] = {"kind": kind, "args": [a, b]}
        with torch.inference_mode():
            row["eager"] = kernel_profile(calls(), bench.device)
        for label, no_math in (("graph_default", False), ("graph_no_math", True)):
            try:
                ms, top = bench.graph_ms(calls, no_math=no_math, diagnose=True)
                row[label] = {"replay_ms": ms, "kernels": top}
            except Exception as exc:
                row[label] = {"error": repr(exc)[:400]}
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        out.append(row)
        del calls
        torch.cuda.empty_cache()
    return out


def meta(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(bench.device),
        "dtype": "bfloat16",
        "attn_implementation": bench.model.config._attn_implementation,
        "model_shape": TINY if args.tiny else LLAMA3_8B,
        "params": sum(p.numel() for p in bench.model.parameters()),
        "warmup": bench.warmup,
        "reps": bench.reps,
        "cache": "transformers DynamicCache (torch.cat per step)",
        "logits_to_keep": 1,
        "graph_capture_sdpa": "flash or mem-efficient only (math fallback excluded)",
    }
    if bench.device.type == "cuda":
        props = torch.cuda.get_device_properties(bench.device)
        info.update(
            gpu=props.name,
            sm_count=props.multi_processor_count,
            gpu_mem_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    return info


def graph_pass(bench: Bench, points: list[Point], max_prefill: int) -> None:
    """Last, after every eager timing is saved: a failed capture must not spoil them. Decode
    first (where launch gaps dominate); gives up after three failures in a row."""
    failures = 0
    order = [p for p in points if p.kind == "decode"] + [
        p for p in points if p.kind == "prefill" and p.new_tokens <= max_prefill
    ]
    for p in order:
        if failures >= 3:
            break
        if p.kind == "decode":
            calls = bench.decode_calls(p.batch, p.cached_tokens)
        else:
            calls = bench.prefill_calls(p.new_tokens, p.cached_tokens)
        try:
            p.graph_ms = bench.graph_ms(calls)[0]
            failures = 0
        except Exception as exc:  # capture refused (a host sync inside the forward, say)
            p.graph_error = repr(exc)[:300]
            failures += 1
        del calls
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print(
            f"graph   {p.kind:7s} B={p.batch:<4d} n={p.new_tokens:<6d} c={p.cached_tokens:<6d} "
            f"graph={p.graph_ms}  error={p.graph_error}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model + short sweep (smoke test)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument(
        "--graph-max-prefill",
        type=int,
        default=4096,
        help="also replay prefill steps up to this many new tokens as CUDA graphs",
    )
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2

    t_start = time.perf_counter()
    bench = Bench(args)
    result: dict[str, Any] = {"meta": meta(bench, args), "sanity": sanity(bench.device, args.tiny)}
    print(json.dumps(result, indent=1), flush=True)
    prefill_n = PREFILL_N[:3] if args.tiny else PREFILL_N
    prefix = PREFILL_PREFIX[:2] if args.tiny else PREFILL_PREFIX
    decode = DECODE_POINTS[:3] if args.tiny else DECODE_POINTS

    points: list[Point] = []

    def record(p: Point) -> None:
        points.append(p)
        print(
            f"{p.kind:7s} B={p.batch:<4d} n={p.new_tokens:<6d} c={p.cached_tokens:<6d} "
            f"median={p.median_ms:9.3f} ms  host={statistics.median(p.host_issue_ms):8.3f} ms  "
            f"kernels={p.gpu_kernel_ms if p.gpu_kernel_ms is None else round(p.gpu_kernel_ms, 3)}"
            f"  gqa_native={p.gqa_native}  kv_append={p.kv_append_ms} "
            f"kv_append_kernels={p.kv_append_kernel_ms}",
            flush=True,
        )
        result["points"] = [asdict(q) for q in points]
        result["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        with open(args.out, "w") as fh:  # rewritten after every point: a timeout keeps the rest
            json.dump(result, fh, indent=1)

    for n in prefill_n:
        record(bench.prefill(n, 0))
    for n, c in prefix:
        record(bench.prefill(n, c))
    for b, k in decode:
        record(bench.decode(b, k))
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    if bench.device.type == "cuda":
        result["meta"]["max_memory_allocated_gib"] = round(
            torch.cuda.max_memory_allocated() / 2**30, 1
        )
        result["graph_diagnosis"] = diagnose_graphs(bench)
        graph_pass(bench, points, args.graph_max_prefill)
    result["points"] = [asdict(q) for q in points]
    result["meta"]["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out} ({len(points)} points, {result['meta']['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
