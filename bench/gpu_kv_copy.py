"""How fast a GPU loads a cached prefix's KV back from host memory (and offloads it): what
kvgate's ``predictors.host_load_gbps`` stands for (a HiCache L2 / LMCache CPU-tier hit,
``routing/estimates.py``), measured on a real card instead of assumed.

Llama-3-8B's KV (32 layers, 8 KV heads, head_dim 128, bf16: 131,072 bytes a token) for a prefix
of n tokens, host to GPU, in the layouts the host tiers use:
- ``bulk``: one contiguous pinned buffer, one copy (the link's ceiling);
- ``layer_first``: one copy per layer and K/V (64 copies of n tokens each; LMCache's chunks,
  HiCache's layer-first host layout), into a contiguous per-layer GPU cache;
- ``paged``: one copy per page of 16 tokens per layer and K/V (HiCache's "direct" I/O into
  vLLM/SGLang-style paged GPU memory; n/16*64 small copies);
- ``staged_scatter``: one bulk copy into a GPU staging buffer, then a gather kernel that
  scatters the pages into a paged cache (LMCache's way);
- ``pageable_bulk``: bulk from ordinary (unpinned) memory, what an offload without pinning gets;
- ``offload_bulk``: GPU to pinned host, the write side of the tier.
Median of the repeats (CUDA events around the whole copy, synced), GB/s = bytes / time.

    python3 -m bench.gpu_kv_copy --out $OUT/kv-copy.json
    python3 -m bench.gpu_kv_copy --tiny --device cpu --out /tmp/k.json   # smoke test
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu_timing import Timer, bench_device, bench_parser, write_json

LAYERS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3-8B
PAGE = 16  # tokens a page (vLLM's default block size; SGLang's page_size 1..64)
TOKENS = (256, 1024, 4096, 16384)
TINY_TOKENS = (64, 256)


def bytes_per_token(layers: int) -> int:
    return layers * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16


class KvCopy:
    """The host and GPU buffers for the largest prefix; each case copies a prefix of them."""

    def __init__(self, device: torch.device, max_tokens: int, layers: int) -> None:
        self.device, self.layers = device, layers
        pin = device.type == "cuda"
        per_layer = (2, max_tokens, KV_HEADS, HEAD_DIM)  # K and V, token-major
        shape = (layers, *per_layer)
        self.host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pin)
        self.host.copy_(torch.randn(shape, dtype=torch.bfloat16, device=device))
        self.pageable = torch.empty(shape, dtype=torch.bfloat16).copy_(self.host)
        self.gpu = torch.empty(self.host.shape, dtype=torch.bfloat16, device=device)
        pages = max_tokens // PAGE
        # the paged cache: pages scattered in a pool twice the prefix's size (as a busy engine's)
        self.pool = torch.empty(
            (layers, 2, 2 * pages, PAGE, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device
        )
        gen = torch.Generator().manual_seed(0)
        self.slots = torch.randperm(2 * pages, generator=gen)[:pages].to(device)
        self.slot_list = self.slots.tolist()
        self.staging = torch.empty_like(self.gpu)

    def cases(self, n: int) -> dict[str, Callable[[], Any]]:
        pages = n // PAGE
        host, gpu = self.host[:, :, :n], self.gpu[:, :, :n]
        bulk_bytes = n * bytes_per_token(self.layers)
        # bulk: the same number of bytes as one contiguous run (a tier's chunk of this prefix)
        bulk_src = self.host.view(-1)[: bulk_bytes // 2]
        bulk_dst = self.gpu.view(-1)[: bulk_bytes // 2]
        chunk_shape = (self.layers, 2, pages, PAGE, KV_HEADS, HEAD_DIM)
        staged = self.staging.view(-1)[: bulk_bytes // 2].view(chunk_shape)
        paged_src = self.host[:, :, :n].unflatten(2, (pages, PAGE))
        slots = self.slots[:pages]

        def layer_first() -> None:
            for layer in range(self.layers):
                for kv in range(2):
                    gpu[layer, kv].copy_(host[layer, kv], non_blocking=True)

        def paged() -> None:
            for layer in range(self.layers):
                for kv in range(2):
                    for page, slot in enumerate(self.slot_list[:pages]):
                        self.pool[layer, kv, slot].copy_(
                            paged_src[layer, kv, page], non_blocking=True
                        )

        def staged_scatter() -> None:
            staged.view(-1).copy_(bulk_src, non_blocking=True)
            self.pool.index_copy_(2, slots, staged)

        return {
            "bulk": lambda: bulk_dst.copy_(bulk_src, non_blocking=True),
            "layer_first": layer_first,
            "paged": paged,
            "staged_scatter": staged_scatter,
            "pageable_bulk": lambda: bulk_dst.copy_(
                self.pageable.view(-1)[: bulk_bytes // 2], non_blocking=True
            ),
            "offload_bulk": lambda: bulk_src.copy_(bulk_dst, non_blocking=True),
        }

    def check(self, n: int) -> bool:
        """The paged and staged copies put every page where its slot says (checked once)."""
        pages = n // PAGE
        cases = self.cases(n)
        chunk_shape = (self.layers, 2, pages, PAGE, KV_HEADS, HEAD_DIM)
        bulk = self.host.view(-1)[: n * bytes_per_token(self.layers) // 2].view(chunk_shape)
        wants = {
            "paged": self.host[:, :, :n].unflatten(2, (pages, PAGE)),  # per-layer host layout
            "staged_scatter": bulk,  # one contiguous chunk on the host
        }
        ok = True
        for name, want in wants.items():
            self.pool.zero_()
            cases[name]()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            ok &= bool(torch.equal(self.pool[:, :, self.slots[:pages]], want.to(self.device)))
        return ok


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(
        "python3 -m bench.gpu_kv_copy", __doc__, warmup=2, reps=7, tiny="2 layers, short prefixes"
    ).parse_args(argv)
    device = bench_device(args.device)
    if device is None:
        return 2
    t0 = time.perf_counter()
    layers, tokens = (2, TINY_TOKENS) if args.tiny else (LAYERS, TOKENS)
    kv = KvCopy(device, max(tokens), layers)
    if not kv.check(min(tokens)):
        print("error: a paged copy put pages in the wrong slots", file=sys.stderr)
        return 1
    timer, rows = Timer(device), []
    for n in tokens:
        size = n * bytes_per_token(layers)
        for name, fn in kv.cases(n).items():
            samples = timer.samples(fn, args.warmup, args.reps)
            ms = statistics.median(samples)
            rows.append(
                {
                    "case": name,
                    "tokens": n,
                    "bytes": size,
                    "median_ms": ms,
                    "samples_ms": samples,
                    "gb_per_s": size / (ms / 1000.0) / 1e9,
                }
            )
            print(
                f"n={n:>6} {name:>15}: {ms:8.3f} ms  {rows[-1]['gb_per_s']:7.1f} GB/s "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    meta: dict[str, Any] = {
        "script": "bench/gpu_kv_copy.py",
        "bytes_per_token": bytes_per_token(layers),
        "page_tokens": PAGE,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "warmup": args.warmup,
        "reps": args.reps,
    }
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_properties(device).name
    meta["script_seconds"] = round(time.perf_counter() - t0, 1)
    write_json(args.out, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
