"""CPU per request of turning a chat body into block hashes: approximate vs engine-exact.

Workload: ~2k-token chat prompts, a system prompt of ~1.5k tokens shared by many requests
(``--systems`` distinct ones, requests cycle through them) plus a unique user turn. Measured
with the process CPU clock over a bounded number of requests, per encoder:

- ``approx``: today's default (messages joined as text, ApproxTokenizer at 4 chars/token);
- ``exact_uncached``: the model's chat template + whole-text ``tokenizers`` encoding;
- ``exact_cached``: the same with the per-stretch token cache (what the gateway runs).

Each is reported for encoding alone and with block hashing (a fresh ``BlockHasher`` per
encoder, so its memo helps all three alike). Run:
``python -m bench.prompt_encode --model-dir ~/.cache/kvgate-engines/vllm-0.32.0/tiny-model``
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backends.model_files import load_prompt_encoder
from routing.hashing import BlockHasher
from routing.prompt_encoder import CHAT_PATH, ApproxPromptEncoder, EnginePromptEncoder
from routing.tokenizer import ApproxTokenizer

DEFAULT_MODEL_DIR = Path.home() / ".cache/kvgate-engines/vllm-0.32.0/tiny-model"
_ASCII_TEXT = (
    "the cache holds prefix prompt gateway routes instance block tokens hashed parent chained "
    "engine request decode prefill latency budget careful assistant answer question policy "
    "system user model queue batch memory transfer replica cluster schedule admission error "
    'Paris 2024 json {"key": 1} def f(x): return x\n\t'
)
_ASCII_WORDS = _ASCII_TEXT.split(" ")
# Mixed: some non-ASCII words, which take ApproxTokenizer off its fast path.
_MIXED_WORDS = [*_ASCII_WORDS, "données", "réseau", "数据", "Grüße"]


def _text(rng: random.Random, vocab: list[str], tokens: int, count: Callable[[str], int]) -> str:
    """Random words until ``count(text)`` reaches ``tokens`` (grown in chunks: cheap)."""
    words: list[str] = []
    while True:
        words.extend(rng.choice(vocab) for _ in range(64))
        text = " ".join(words)
        if count(text) >= tokens:
            return text


def workload(
    encoder: EnginePromptEncoder,
    vocab: list[str],
    requests: int,
    systems: int,
    system_tokens: int = 1500,
    user_tokens: int = 500,
    seed: int = 0,
) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def count(t: str) -> int:
        return encoder.encode("/v1/completions", {"prompt": t}).n_tokens

    prompts = [_text(rng, vocab, system_tokens, count) for _ in range(systems)]
    return [
        {
            "messages": [
                {"role": "system", "content": prompts[i % systems]},
                {
                    "role": "user",
                    "content": f"request {i}: " + _text(rng, vocab, user_tokens, count),
                },
            ]
        }
        for i in range(requests)
    ]


def _cpu_us(fn: Callable[[dict[str, Any]], Any], bodies: list[dict[str, Any]]) -> float:
    t0 = time.process_time()
    for body in bodies:
        fn(body)
    return (time.process_time() - t0) / len(bodies) * 1e6


def _measure(make: Callable[[], Any], runs: list[list[dict[str, Any]]], *, hashing: bool) -> float:
    """Best (least disturbed) of the runs; every run has its own user turns and a fresh
    encoder, so user turns are never cache hits, while a run's shared system prompts are
    (after their first request, as in steady state)."""
    best = float("inf")
    for bodies in runs:
        enc, hasher = make(), BlockHasher(16)

        def one(b: dict[str, Any], enc: Any = enc, hasher: BlockHasher = hasher) -> Any:
            tokens = enc.encode(CHAT_PATH, b)
            return hasher.hash_packed(tokens.packed) if hashing else tokens

        us = _cpu_us(one, bodies)
        best = min(best, us)
    return round(best, 1)


def run_workload(
    model_dir: Path, vocab: list[str], requests: int, systems: int, reps: int
) -> dict[str, Any]:
    probe = load_prompt_encoder(model_dir)
    runs = [workload(probe, vocab, requests, systems, seed=r) for r in range(reps)]
    uncached = load_prompt_encoder(model_dir, segment_cache_bytes=0)
    mismatches = sum(
        probe.encode(CHAT_PATH, b).packed != uncached.encode(CHAT_PATH, b).packed for b in runs[0]
    )
    if mismatches:
        raise RuntimeError(f"the segment cache changed {mismatches} prompts' tokens")
    makers: dict[str, Callable[[], Any]] = {
        "approx": lambda: ApproxPromptEncoder(ApproxTokenizer(4.0)),
        "exact_uncached": lambda: uncached,
        "exact_cached": lambda: load_prompt_encoder(model_dir),
    }
    bodies = runs[0]
    approx = ApproxPromptEncoder(ApproxTokenizer(4.0))
    out: dict[str, Any] = {
        "exact_prompt_tokens_mean": round(
            sum(probe.encode(CHAT_PATH, b).n_tokens for b in bodies) / len(bodies), 1
        ),
        "approx_prompt_tokens_mean": round(
            sum(approx.encode(CHAT_PATH, b).n_tokens for b in bodies) / len(bodies), 1
        ),
        "us_per_request": {k: _measure(m, runs, hashing=False) for k, m in makers.items()},
        "us_per_request_with_hashing": {
            k: _measure(m, runs, hashing=True) for k, m in makers.items()
        },
        "render_only_us": round(min(_cpu_us(probe.render_chat, b) for b in runs), 1),
    }
    hashed = out["us_per_request_with_hashing"]
    out["added_us_exact_cached_vs_approx"] = round(hashed["exact_cached"] - hashed["approx"], 1)
    return out


def run(model_dir: Path, requests: int, systems: int, reps: int) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir),
        "requests_per_run": requests,
        "runs": reps,
        "distinct_system_prompts": systems,
        "system_tokens_target": 1500,
        "user_tokens_target": 500,
        "segment_split_exact": load_prompt_encoder(model_dir).segments.exact,
        "workloads": {
            "ascii": run_workload(model_dir, _ASCII_WORDS, requests, systems, reps),
            "mixed_unicode": run_workload(model_dir, _MIXED_WORDS, requests, systems, reps),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if not (args.model_dir / "tokenizer.json").is_file():
        print(f"no tokenizer.json in {args.model_dir}", file=sys.stderr)
        return 2
    if not 1 <= args.requests <= 20_000 or not 1 <= args.reps <= 10 or args.systems < 1:
        print("--requests in [1, 20000], --reps in [1, 10], --systems >= 1", file=sys.stderr)
        return 2
    print(json.dumps(run(args.model_dir, args.requests, args.systems, args.reps), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
