"""Mixed chunked-prefill steps on one GPU: a prefill chunk and a batch of decoding sequences in
one forward, as vLLM V1 schedules them under chunked prefill.

kvgate's simulator and emulator time every step with one form (calibration README §3, U3,
``replay/engine/timing.py``): ``a + b*max(T, T0) + c*attn + k*K``, T the step's tokens (chunk +
one per decoding sequence), attn the chunk's causal pairs ``n*(cached + n/2)``, K the decoding
sequences' context. It was fitted to *composed* kernel tables, never to a measured mixed step.
This bench measures, in one run, the mixed steps and the same chunk alone and the same decode
batch alone, so that the form can be fitted to real steps and the mixing itself checked: is a
mixed step cheaper than its two halves run apart (the weights read once), as U3 says?

The model and timing are ``bench/gpu_engine_steps.py``'s (engine-like forward: fused GEMMs over
all the step's tokens, KV written in place, the fastest PyTorch attention kernel per point,
CUDA-graph replay). The chunk's and the decode rows' attention run as two kernels (vLLM V1 runs
one varlen kernel over both). Stdlib + torch only, like its siblings.

    python3 -m bench.gpu_mixed_steps --out $OUT/mixed-steps.json
    python3 -m bench.gpu_mixed_steps --tiny --device cpu --out /tmp/m.json   # smoke test
    .venv/bin/python -m bench.compare_gpu_profile --steps docs/data/gpu-mixed-steps-h200.json
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from bench.gpu_attention import Shape
from bench.gpu_engine_steps import (
    KV,
    Bench,
    EngineLlama,
    Point,
    checked_model,
    meta,
)
from bench.gpu_points import LLAMA3_8B, TINY
from bench.gpu_timing import bench_device, bench_parser, write_json

# Chunks as vLLM's token budget cuts them (8,192 tokens a step on an H100/H200 by default),
# behind no prefix or a 4k one; decode batches as a busy colocated engine holds them.
MIXED_CHUNK = ((256, 0), (1024, 0), (2048, 0), (256, 4096), (1024, 4096), (2048, 4096))
MIXED_DECODE = ((8, 4096), (32, 2048), (64, 1024), (128, 2048))  # (B, K per sequence)
TINY_PLAN = [((32, 0), (4, 64)), ((16, 64), (2, 128))]


def forward_mixed(
    m: EngineLlama,
    chunk: torch.Tensor,
    cached: int,
    chunk_cache: KV,
    dec: torch.Tensor,
    context: int,
    dec_cache: KV,
) -> torch.Tensor:
    """One step: ``chunk`` (1, n) new prompt tokens behind ``cached`` ones, and ``dec`` (B, 1)
    next tokens of B sequences holding ``context`` tokens each. GEMMs run once over all n + B
    rows; logits for the chunk's last position and every decode row."""
    s, n, batch = m.s, chunk.shape[1], dec.shape[0]
    x = F.embedding(torch.cat((chunk[0], dec[:, 0])), m.embed)  # (n + B, hidden)
    q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for layer, (kc, vc), (kd, vd) in zip(m.layers, chunk_cache, dec_cache, strict=True):
        h = F.rms_norm(x, (s.hidden,), layer.ln1, 1e-5)
        q, k, v = F.linear(h, layer.qkv).split((q_size, kv_size, kv_size), dim=-1)
        outs = []
        for rows, start, kcache, vcache in (
            (slice(0, n), cached, kc, vc),
            (slice(n, n + batch), context, kd, vd),
        ):
            b, t = (1, n) if rows.start == 0 else (batch, 1)
            qr = m.rope(q[rows].view(b, t, s.heads, s.head_dim), start)
            kr = m.rope(k[rows].view(b, t, s.kv_heads, s.head_dim), start)
            kcache[:, :, start : start + t].copy_(kr.transpose(1, 2))
            vcache[:, :, start : start + t].copy_(
                v[rows].view(b, t, s.kv_heads, -1).transpose(1, 2)
            )
            end = start + t
            out = m.attention(qr.transpose(1, 2), kcache[:, :, :end], vcache[:, :, :end])
            outs.append(out.transpose(1, 2).reshape(b * t, q_size))
        x = x + F.linear(torch.cat(outs), layer.o)
        h = F.rms_norm(x, (s.hidden,), layer.ln2, 1e-5)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
    last = F.rms_norm(x[n - 1 :], (s.hidden,), m.final_norm, 1e-5)  # chunk's last + decodes
    return F.linear(last, m.lm_head)


def mixed_point(
    bench: Bench, n: int, cached: int, batch: int, context: int, usable: dict[str, list[str]]
) -> Point:
    m = bench.model
    chunk = torch.randint(0, m.s.vocab, (1, n), device=m.device)
    dec = torch.randint(0, m.s.vocab, (batch, 1), device=m.device)
    chunk_cache, dec_cache = m.new_cache(1, cached + n), m.new_cache(batch, context + 1)
    with torch.inference_mode():
        picked = {
            f"{kind}:{name}": ms
            for kind, new, cache in (("prefill", n, chunk_cache), ("decode", 1, dec_cache))
            for name, ms in bench.pick_kernel(kind, new, *cache[0], usable[kind]).items()
        }

    def step() -> torch.Tensor:
        return forward_mixed(m, chunk, cached, chunk_cache, dec, context, dec_cache)

    shape = Point("mixed", n, cached, 1, decode_batch=batch, decode_context=context)
    return bench.timed(shape, step, picked)


def plan(tiny: bool) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((n, cached), (B, K)) of every mixed step; each half is also timed alone."""
    if tiny:
        return TINY_PLAN
    return [(c, d) for d in MIXED_DECODE for c in MIXED_CHUNK]


def main(argv: list[str] | None = None) -> int:
    args = bench_parser("python3 -m bench.gpu_mixed_steps", __doc__).parse_args(argv)
    device = bench_device(args.device)
    if device is None:
        return 2
    t0 = time.perf_counter()
    found = checked_model(Shape.from_hf(TINY if args.tiny else LLAMA3_8B), device)
    if found is None:
        return 1
    model, checks, usable = found
    bench, points = Bench(model, args.warmup, args.reps), []
    todo = plan(args.tiny)
    alone: dict[tuple[str, int, int], Point] = {}
    for i, ((n, cached), (batch, context)) in enumerate(todo, 1):
        for key in (("prefill", n, cached), ("decode", batch, context)):
            if key not in alone:  # each half alone, timed once, in the same run
                kind, a, b = key
                pt = bench.point(
                    kind, *((1, a, b) if kind == "prefill" else (a, 1, b)), usable[kind]
                )
                alone[key] = pt
                points.append(pt)
        pt = mixed_point(bench, n, cached, batch, context, usable)
        points.append(pt)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        graph = "-" if pt.median_ms is None else f"{pt.median_ms:.2f}"
        halves = [alone[("prefill", n, cached)], alone[("decode", batch, context)]]
        apart = "-"
        if all(h.median_ms is not None for h in halves):
            apart = f"{sum(h.median_ms for h in halves):.2f}"  # type: ignore[misc]
        print(
            f"[{i}/{len(todo)}] chunk n={n} cached={cached} + decode B={batch} K={context}: "
            f"graph {graph} ms (halves apart {apart} ms), eager {pt.eager_ms:.2f} ms "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    data = {"meta": meta(model, args, checks), "points": [asdict(x) for x in points]}
    data["meta"]["script"] = "bench/gpu_mixed_steps.py"
    data["meta"]["script_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
