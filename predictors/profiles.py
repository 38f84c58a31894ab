"""Engine profiles: calibrated step-time coefficients per (model, GPU, TP), embedded as data.

Source: the kvgate calibration study (``calibration/README.md`` §3-§6 and
``calibration/results/fit_results.json`` key ``C_composed``). The README §4 table shows rounded
values; the numbers below are the unrounded ones from ``fit_results.json``. They describe composed
**GPU time in ms** (aiconfigurator kernel tables + vidur elementwise ops, vLLM kernels, bf16) and
exclude the per-step engine overhead, which README §5 puts at ~0.5 ms for vLLM V1/SGLang with CUDA
graphs (our default ``overhead_ms``). The calibration files are not shipped with kvgate, so the
coefficients live here as plain data; only offline eval/tests read the grids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

_Row = tuple[str, int, int, tuple[float, ...], tuple[float, ...], tuple[float, ...]]
_SOURCE = "calibration README §4 / fit_results.json C_composed[{config}] (composed GPU ms, bf16)"


@dataclass(frozen=True, slots=True)
class PrefillCoeffs:
    """P5: ``a + b*max(n, n0) + c*n*(cached + n/2)`` ms (README §3; MAPE 2.5-4.6 %)."""

    a_ms: float
    b_ms: float
    n0: int
    c_ms: float

    def gpu_ms(self, new_tokens: float, cached_tokens: float) -> float:
        n = new_tokens
        return self.a_ms + self.b_ms * max(n, self.n0) + self.c_ms * n * (cached_tokens + n / 2)


@dataclass(frozen=True, slots=True)
class DecodeCoeffs:
    """D2: ``a + b*B + k*K`` ms, B sequences decoding, K their total context (README §3)."""

    a_ms: float
    b_ms: float
    k_ms: float

    def gpu_ms(self, batch: float, context_tokens: float) -> float:
        return self.a_ms + self.b_ms * batch + self.k_ms * context_tokens


@dataclass(frozen=True, slots=True)
class MixedCoeffs:
    """U3: ``a + b*max(T, T0) + c*attn + k*K`` ms for a chunked-prefill step (README §3)."""

    a_ms: float
    b_ms: float
    t0: int
    c_ms: float
    k_ms: float

    def gpu_ms(self, total_tokens: float, attn_pairs: float, context_tokens: float) -> float:
        return (
            self.a_ms
            + self.b_ms * max(total_tokens, self.t0)
            + self.c_ms * attn_pairs
            + self.k_ms * context_tokens
        )


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str  # registry key, "<model>-<gpu>-tp<N>" lowercase
    model: str
    gpu: str
    tp: int
    prefill: PrefillCoeffs
    decode: DecodeCoeffs
    mixed: MixedCoeffs
    kv_bytes_per_token: int  # whole model (all TP shards), bf16 — what a KV transfer moves
    kv_capacity_tokens: int  # README §6 estimate at gpu_memory_utilization 0.9
    overhead_ms: float  # per-step engine overhead on top of the GPU model (README §5)
    max_batch: int  # vLLM V1 default max_num_seqs for this GPU (README §6)
    max_batched_tokens: int  # vLLM V1 API-server default max_num_batched_tokens (README §6)
    grid_config: str  # config name in the calibration grids, e.g. "Llama-3-8B/H100/TP1"
    source: str
    # True for a profile measured on a live engine (predictors/calibration.py): its times hold
    # the per-step overhead already, so predictors.overhead_ms is not added on top.
    includes_overhead: bool = False


# fmt: off
# (grid config, KV bytes/token, KV capacity tokens, P5 (a, b, n0, c), D2 (a, b, k),
#  U3 (a, b, T0, c, k)) — copied verbatim from fit_results.json C_composed.
_TABLE: tuple[_Row, ...] = (
    ("Llama-2-7B/H100/TP1", 524288, 112648,
     (1.62615, 0.0196944, 256, 7.70092e-07), (6.0729, 0.0148222, 0.000168261),
     (2.91732, 0.0200211, 192, 7.24189e-07, 0.00016792)),
    ("Llama-3-8B/H100/TP1", 131072, 430880,
     (1.98576, 0.0211155, 256, 7.41844e-07), (6.76616, 0.0110881, 4.24591e-05),
     (3.48322, 0.020637, 192, 7.96638e-07, 4.272e-05)),
    ("Qwen2.5-7B/H100/TP1", 57344, 999332,
     (2.88867, 0.0191068, 192, 5.74299e-07), (6.23285, 0.00942817, 1.90079e-05),
     (3.08969, 0.0192441, 192, 5.686e-07, 1.97205e-05)),
    ("Llama-2-70B/H100/TP2", 327680, 21734,
     (3.44827, 0.107301, 256, 1.90658e-06), (28.3615, 0.0385878, 5.38686e-05),
     (10.6477, 0.103562, 192, 1.9992e-06, 4.73793e-05)),
    ("Llama-2-70B/H100/TP4", 327680, 464461,
     (6.15944, 0.062499, 192, 9.59242e-07), (16.1046, 0.0326494, 2.78008e-05),
     (6.23089, 0.064069, 192, 8.70962e-07, 2.80528e-05)),
    ("Llama-2-70B/H100/TP8", 327680, 1349914,
     (6.69631, 0.0391689, 128, 5.01129e-07), (10.3862, 0.0265391, 1.38923e-05),
     (6.90427, 0.0401562, 128, 4.47655e-07, 1.43517e-05)),
    ("Llama-3-70B/H100/TP4", 327680, 454835,
     (6.29988, 0.062509, 192, 9.58912e-07), (16.2486, 0.0327655, 2.77877e-05),
     (6.58958, 0.0638689, 192, 8.43389e-07, 2.78374e-05)),
    ("Llama-3-70B/H100/TP8", 327680, 1340288,
     (6.76057, 0.0391717, 128, 5.01053e-07), (10.4516, 0.0265937, 1.38917e-05),
     (7.00887, 0.0403169, 128, 4.1775e-07, 1.44952e-05)),
    ("Llama-2-7B/A100/TP1", 524288, 112648,
     (4.49603, 0.0545661, 128, 2.99686e-06), (10.3248, 0.0289704, 0.000335323),
     (7.18245, 0.0528685, 64, 3.0688e-06, 0.000325348)),
    ("Llama-3-8B/A100/TP1", 131072, 430880,
     (5.16524, 0.0571964, 128, 3.02239e-06), (11.3518, 0.037949, 8.0802e-05),
     (5.51466, 0.057287, 128, 3.1018e-06, 8.83105e-05)),
    ("Qwen2.5-7B/A100/TP1", 57344, 999332,
     (5.15424, 0.0538179, 128, 2.24435e-06), (10.779, 0.0368081, 3.66179e-05),
     (8.0981, 0.052129, 64, 2.35193e-06, 3.8324e-05)),
    ("Llama-2-70B/A100/TP2", 327680, 21734,
     (20.9516, 0.272054, 128, 7.42749e-06), (49.8405, 0.156661, 9.30086e-05),
     (34.9151, 0.258445, 64, 8.12082e-06, 0.000133533)),
    ("Llama-2-70B/A100/TP4", 327680, 464461,
     (20.5118, 0.154533, 64, 3.64418e-06), (28.357, 0.114465, 5.44104e-05),
     (21.0716, 0.157171, 64, 3.64274e-06, 5.72437e-05)),
    ("Llama-2-70B/A100/TP8", 327680, 1349914,
     (13.4702, 0.101714, 64, 1.69216e-06), (18.0703, 0.0803054, 2.64182e-05),
     (13.3889, 0.105955, 64, 1.37164e-06, 2.78293e-05)),
    ("Llama-3-70B/A100/TP4", 327680, 454835,
     (20.7429, 0.15455, 64, 3.64369e-06), (28.5825, 0.115216, 5.439e-05),
     (21.4769, 0.156627, 64, 3.66207e-06, 5.75688e-05)),
    ("Llama-3-70B/A100/TP8", 327680, 1340288,
     (13.6043, 0.101721, 64, 1.69177e-06), (18.1947, 0.0807711, 2.64085e-05),
     (13.2727, 0.106156, 64, 1.47189e-06, 2.78926e-05)),
)
# fmt: on

# Registry names drop the dash between family and version ("Llama-3-8B" -> "llama3-8b").
_MODEL_SLUG = {
    "Llama-2-7B": "llama2-7b",
    "Llama-3-8B": "llama3-8b",
    "Qwen2.5-7B": "qwen2.5-7b",
    "Llama-2-70B": "llama2-70b",
    "Llama-3-70B": "llama3-70b",
}
# vLLM V1 defaults (README §6): H100 (>=70 GiB, non-A100) 1024 seqs / 8192 batched tokens;
# A100 256 / 2048.
_ENGINE_LIMITS = {"H100": (1024, 8192), "A100": (256, 2048)}
DEFAULT_OVERHEAD_MS = 0.5  # README §5: vLLM V1 / SGLang with CUDA graphs, TP1-4


def _build(row: _Row) -> EngineProfile:
    config, kv_bytes, kv_cap, p5, d2, u3 = row
    model, gpu, tp_s = config.split("/")
    tp = int(tp_s.removeprefix("TP"))
    max_batch, max_tokens = _ENGINE_LIMITS[gpu]
    return EngineProfile(
        name=f"{_MODEL_SLUG[model]}-{gpu.lower()}-tp{tp}",
        model=model,
        gpu=gpu,
        tp=tp,
        prefill=PrefillCoeffs(a_ms=p5[0], b_ms=p5[1], n0=int(p5[2]), c_ms=p5[3]),
        decode=DecodeCoeffs(a_ms=d2[0], b_ms=d2[1], k_ms=d2[2]),
        mixed=MixedCoeffs(a_ms=u3[0], b_ms=u3[1], t0=int(u3[2]), c_ms=u3[3], k_ms=u3[4]),
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=kv_cap,
        overhead_ms=DEFAULT_OVERHEAD_MS,
        max_batch=max_batch,
        max_batched_tokens=max_tokens,
        grid_config=config,
        source=_SOURCE.format(config=config),
    )


def _splitwise_2023() -> EngineProfile:
    """LLaMA2-70B on 8x A100 as a 2023-era engine measured end to end (Splitwise
    ``perf_model.csv``; calibration README section 4, second table): decode
    ``44.07 + 0.1897*B + 3.354e-4*K`` ms (MAPE 1.8 %), prefill ~``0.1565*n`` ms beyond a fixed
    step cost. The KV-read cost k is 12x the composed model's: the paged-attention kernels and
    CPU-bound scheduling of that stack. Closer to the Mooncake papers' deployment than today's
    vLLM; the composed attention term c is kept because Splitwise cannot separate it."""
    base = _build(next(r for r in _TABLE if r[0] == "Llama-2-70B/A100/TP8"))
    return replace(
        base,
        name="llama2-70b-a100-tp8-2023",
        prefill=PrefillCoeffs(a_ms=44.07, b_ms=0.1565, n0=1, c_ms=base.prefill.c_ms),
        decode=DecodeCoeffs(a_ms=44.07, b_ms=0.1897, k_ms=3.354e-4),
        mixed=MixedCoeffs(a_ms=44.07, b_ms=0.1565, t0=1, c_ms=base.prefill.c_ms, k_ms=3.354e-4),
        overhead_ms=0.0,
        grid_config="",  # not a composed-grid config: no offline eval grid
        source="Splitwise end-to-end measurements (LLaMA2-70B, DGX-A100, TP8), fit_results.json "
        "A_splitwise; attention term from the composed model",
    )


PROFILES: Mapping[str, EngineProfile] = MappingProxyType(
    {p.name: p for p in (*map(_build, _TABLE), _splitwise_2023())}
)
# Profile name -> calibration grid config name (used by offline eval).
GRID_CONFIGS: Mapping[str, str] = MappingProxyType(
    {n: p.grid_config for n, p in PROFILES.items() if p.grid_config}
)
_BY_CONFIG: Mapping[str, str] = MappingProxyType({c: n for n, c in GRID_CONFIGS.items()})


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown engine profile {name!r}; known profiles: {known}") from None


def profile_name_for_config(config: str | None) -> str | None:
    """Registry name for a calibration grid config ("Llama-3-8B/H100/TP1"), or None if unknown."""
    return _BY_CONFIG.get(config) if config is not None else None


@dataclass(frozen=True, slots=True)
class FlopsPrefill:
    """Mooncake (FAST'25) FLOPs prefill model, defaults for LLaMA2-70B.

    ``flops(n) = l*(a*n^2*d + b*n*d^2)``; a request with ``n`` new tokens behind ``c`` cached ones
    costs ``flops(n+c) - flops(c)`` (the cached prefix's own work is not redone, but its keys are
    attended to), so time = that / ``effective_flops_per_s`` + ``overhead_s``.
    """

    effective_flops_per_s: float
    overhead_s: float = 0.0
    layers: int = 80
    d_model: int = 8192
    attn_coeff: float = 4.0
    linear_coeff: float = 22.0

    def __post_init__(self) -> None:
        if not self.effective_flops_per_s > 0:
            raise ValueError("effective_flops_per_s must be > 0")

    def flops(self, tokens: float) -> float:
        d = self.d_model
        per_layer = self.attn_coeff * tokens * tokens * d + self.linear_coeff * tokens * d * d
        return self.layers * per_layer

    def predict(self, new_tokens: int, cached_tokens: int) -> float:
        work = self.flops(new_tokens + cached_tokens) - self.flops(cached_tokens)
        return work / self.effective_flops_per_s + self.overhead_s

    @classmethod
    def calibrated(
        cls,
        profile: EngineProfile | None = None,
        *,
        new_tokens: int = 8192,
        overhead_s: float = 0.0,
    ) -> FlopsPrefill:
        """Pick the effective FLOP rate so ``predict(new_tokens, 0)`` equals the profile's P5 GPU
        time there (default: llama2-70b-a100-tp8 at n=8192, ~0.90 s => ~1.26e15 FLOP/s, i.e. ~50 %
        of 8x A100 bf16 peak). Matching at a long prompt makes the linear term dominate, where the
        two models agree best; short prompts are then under-predicted (no fixed per-step cost)."""
        prof = profile if profile is not None else PROFILES["llama2-70b-a100-tp8"]
        target_s = prof.prefill.gpu_ms(new_tokens, 0) / 1000.0
        if target_s <= overhead_s:
            raise ValueError("overhead_s must be smaller than the calibration target time")
        probe = cls(effective_flops_per_s=1.0, overhead_s=overhead_s)
        return cls(
            effective_flops_per_s=probe.flops(new_tokens) / (target_s - overhead_s),
            overhead_s=overhead_s,
        )
