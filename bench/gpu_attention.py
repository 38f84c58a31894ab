"""The attention pieces of bench/gpu_engine_steps.py: the model shape, the prefill and decode
attention kernels PyTorch offers (each point of the bench runs the fastest at its shape, as an
engine ships tuned kernels) and a plain-math reference they are checked against. torch only."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right


@dataclass(frozen=True, slots=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Shape:
        return cls(
            d["hidden_size"],
            d["num_hidden_layers"],
            d["num_attention_heads"],
            d["num_key_value_heads"],
            d["intermediate_size"],
            d["vocab_size"],
            d["rope_theta"],
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def _decode_matmul(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One grouped batched matmul over K and one over V, nothing copied."""
    batch, _, _, d = q.shape
    qg = q.view(batch, s.kv_heads, s.group, d)
    probs = torch.softmax(torch.matmul(qg, k.transpose(-1, -2)).float() * d**-0.5, dim=-1)
    return torch.matmul(probs.to(q.dtype), v).view(batch, s.heads, 1, d)


def _decode_packed(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A query head group as a 4-token query of its KV head, no mask (vLLM's FA "ngroups
    swapped" trick): a flash kernel reads each KV head once for the whole group."""
    batch, _, _, d = q.shape
    out = F.scaled_dot_product_attention(q.view(batch, s.kv_heads, s.group, d), k, v)
    return out.view(batch, s.heads, 1, d)


def _decode_gqa(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _decode_cudnn(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _prefill_sdpa(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PyTorch's own choice (FlashAttention-2 or cuDNN): the new tokens see the whole cached
    prefix through a bottom-right causal bias, no mask tensor, no K/V copy."""
    n, total = q.shape[2], k.shape[2]
    mask = causal_lower_right(n, total) if total > n else None
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )


def _prefill_cudnn(s: Shape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """cuDNN's attention (Hopper-native on an H100) forced, the prefix through a boolean mask
    where PyTorch would otherwise pick FlashAttention-2."""
    n, total = q.shape[2], k.shape[2]
    mask = None
    if total > n:
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )


Kernel = Callable[[Shape, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The attention kernels PyTorch offers per step kind; each point runs the fastest at its shape,
# as an engine ships tuned kernels.
PREFILL_KERNELS: dict[str, Kernel] = {"sdpa": _prefill_sdpa, "cudnn": _prefill_cudnn}
DECODE_KERNELS: dict[str, Kernel] = {
    "matmul": _decode_matmul,
    "sdpa_packed": _decode_packed,
    "sdpa_gqa": _decode_gqa,
    "cudnn_gqa": _decode_cudnn,
}


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain math: K/V repeated to every query head, new token i sees the prefix and i' <= i."""
    n, total = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.float()


KERNELS: dict[str, dict[str, Kernel]] = {"prefill": PREFILL_KERNELS, "decode": DECODE_KERNELS}
