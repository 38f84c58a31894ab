"""Check the simulator's one step-time form against measured mixed chunked-prefill steps.

Reads ``bench/gpu_mixed_steps.py`` output (run on a GPU machine; the H200 runs are committed as
``docs/data/gpu-mixed-steps-h200*.json``) and answers three questions with the CUDA-graph replay
times (an engine's step without launch gaps):

1. **Is mixing additive, as U3 says?** U3 (``replay/engine/timing.py``) prices a step
   ``a + b*max(T, T0) + c*attn + k*K``: fitted to the chunk-alone and decode-alone steps only,
   how well does it predict the mixed steps it never saw?
2. **What does mixing save?** A mixed step against its two halves run apart (U3: the fixed cost
   a, the weights' read, is paid once).
3. **How far is the profile?** The profile's own U3 coefficients (what ``kvgate sim`` and the
   emulator use) at the same points, and U3 refitted to every measured step.

    .venv/bin/python -m bench.compare_mixed_steps docs/data/gpu-mixed-steps-h200.json
    .venv/bin/python -m bench.compare_mixed_steps RUN.json [RUN2.json] --markdown --json F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from predictors.fitting import relative_nnls
from predictors.profiles import get_profile
from replay.engine.timing import StepTiming

DEFAULT_PROFILE = "llama3-8b-h100-tp1"
KNEES = (0, 64, 128, 192, 256, 384)


@dataclass(frozen=True, slots=True)
class Step:
    kind: str  # "prefill" | "decode" | "mixed"
    chunk: int  # prefill tokens in the step
    cached: int  # the chunk's cached prefix
    batch: int  # decoding sequences in the step
    context: int  # each one's context
    graph_ms: float  # median CUDA-graph replay

    @property
    def tokens(self) -> int:
        return self.chunk + self.batch

    @property
    def attn(self) -> float:
        return self.chunk * (self.cached + self.chunk / 2)

    @property
    def kv(self) -> int:
        return self.batch * self.context


class InputError(ValueError):
    pass


def load_steps(path: Path) -> list[Step]:
    try:
        points = json.loads(path.read_text())["points"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: cannot read mixed steps: {exc!r}") from None
    steps = []
    for i, p in enumerate(points):
        try:
            ms, kind = p["median_ms"], p["kind"]
            if ms is None:
                raise InputError(
                    f"{path}: points[{i}] has no graph replay ({p.get('graph_error')})"
                )
            if kind == "decode":
                steps.append(Step(kind, 0, 0, p["batch"], p["cached_tokens"], ms))
            else:
                batch, context = p.get("decode_batch", 0), p.get("decode_context", 0)
                steps.append(Step(kind, p["new_tokens"], p["cached_tokens"], batch, context, ms))
        except (KeyError, TypeError) as exc:
            raise InputError(f"{path}: points[{i}] lacks {exc}") from None
    if not any(s.kind == "mixed" for s in steps):
        raise InputError(f"{path}: no mixed steps (not a gpu_mixed_steps.py output?)")
    return steps


@dataclass(frozen=True, slots=True)
class U3:
    a: float
    b: float
    t0: int
    c: float
    k: float

    def ms(self, s: Step) -> float:
        return self.a + self.b * max(s.tokens, self.t0) + self.c * s.attn + self.k * s.kv


def _design(steps: list[Step], t0: int) -> np.ndarray:
    return np.array([[1.0, max(s.tokens, t0), s.attn, s.kv] for s in steps])


def fit_u3(steps: list[Step]) -> U3:
    """U3 by relative non-negative least squares, the knee picked by MAPE (as calibrated)."""
    y = np.array([s.graph_ms for s in steps])
    best: tuple[float, U3] | None = None
    for t0 in KNEES:
        coef = relative_nnls(_design(steps, t0), y)
        form = U3(float(coef[0]), float(coef[1]), t0, float(coef[2]), float(coef[3]))
        err = mape(form, steps)
        if best is None or err < best[0]:
            best = (err, form)
    assert best is not None
    return best[1]


def mape(form: U3, steps: list[Step]) -> float:
    return 100.0 * statistics.fmean(abs(form.ms(s) / s.graph_ms - 1.0) for s in steps)


def profile_u3(name: str) -> U3:
    """The profile's U3 as the simulator's ground truth uses it, GPU time only (no overhead)."""
    t = StepTiming.from_profile(get_profile(name), overhead_ms=0.0)
    return U3(t.a_s * 1e3, t.b_s * 1e3, t.t0, t.c_s * 1e3, t.k_s * 1e3)


def halves(steps: list[Step]) -> list[dict[str, Any]]:
    """Each mixed step against its chunk alone plus its decode batch alone (same run)."""
    alone = {(s.kind, s.chunk, s.cached, s.batch, s.context): s.graph_ms for s in steps}
    out = []
    for s in steps:
        if s.kind != "mixed":
            continue
        pre = alone.get(("prefill", s.chunk, s.cached, 0, 0))
        dec = alone.get(("decode", 0, 0, s.batch, s.context))
        if pre is None or dec is None:
            continue
        out.append(
            {**asdict(s), "apart_ms": pre + dec, "mixed_over_apart": s.graph_ms / (pre + dec)}
        )
    return out


def analyse(steps: list[Step], profile: str) -> dict[str, Any]:
    pure = [s for s in steps if s.kind != "mixed"]
    mixed = [s for s in steps if s.kind == "mixed"]
    from_pure, from_all, prof = fit_u3(pure), fit_u3(steps), profile_u3(profile)
    pairs = halves(steps)
    saving = [p["apart_ms"] - p["graph_ms"] for p in pairs]
    return {
        "profile": profile,
        "steps": {
            "prefill": sum(s.kind == "prefill" for s in steps),
            "decode": sum(s.kind == "decode" for s in steps),
            "mixed": len(mixed),
        },
        "u3_fit_on_pure_steps": asdict(from_pure)
        | {"mape_pure_pct": mape(from_pure, pure), "mape_mixed_pct": mape(from_pure, mixed)},
        "u3_fit_on_all_steps": asdict(from_all) | {"mape_pct": mape(from_all, steps)},
        "profile_u3": asdict(prof)
        | {
            "mape_pct": mape(prof, steps),
            "mixed_measured_over_profile": _spread([s.graph_ms / prof.ms(s) for s in mixed]),
        },
        "mixed_over_apart": _spread([p["mixed_over_apart"] for p in pairs]),
        "saving_ms": _spread(saving),
        "pairs": pairs,
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def table(result: dict[str, Any], markdown: bool) -> str:
    head = ["chunk", "cached", "B", "K", "mixed ms", "apart ms", "mixed/apart"]
    body = [
        [str(p["chunk"]), str(p["cached"]), str(p["batch"]), str(p["context"]),
         f"{p['graph_ms']:.2f}", f"{p['apart_ms']:.2f}", f"{p['mixed_over_apart']:.3f}"]
        for p in result["pairs"]
    ]  # fmt: skip
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join(
        "  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)) for r in [head, *body]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_mixed_steps", description=__doc__)
    p.add_argument("runs", type=Path, nargs="+", help="gpu_mixed_steps.py JSON (one per run)")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="kvgate engine profile name")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    a = p.parse_args(argv)
    try:
        get_profile(a.profile)
        runs = [(path, load_steps(path)) for path in a.runs]
    except (InputError, KeyError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    results = {}
    for path, steps in runs:
        result = analyse(steps, a.profile)
        results[str(path)] = result
        print(f"== {path}")
        print(table(result, a.markdown))
        print(json.dumps({k: v for k, v in result.items() if k != "pairs"}, indent=1))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
