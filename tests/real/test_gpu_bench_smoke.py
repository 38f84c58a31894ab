"""The GPU benches (bench/gpu_*.py) run only on a lent GPU machine, with torch, which kvgate's own
venv lacks. The vLLM CPU install has torch: their tiny CPU mode runs here, so that a change that
breaks them is caught before the next GPU session finds out (their results: docs/gpu-step-times.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.real.conftest import EngineInstall
from tests.real.engines import vllm_model_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def torch_python(vllm_install: EngineInstall) -> str:
    return str(vllm_model_dir().parent / "venv" / "bin" / "python")


def _run(python: str, module: str, out: Path) -> dict:
    cmd = [python, "-m", module, "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_mixed_steps_time_each_mixed_step_and_both_halves(torch_python: str, tmp_path: Path):
    data = _run(torch_python, "bench.gpu_mixed_steps", tmp_path / "m.json")
    kinds = [p["kind"] for p in data["points"]]
    assert kinds.count("mixed") == 2 and kinds.count("prefill") == 2 and kinds.count("decode") == 2
    mixed = [p for p in data["points"] if p["kind"] == "mixed"]
    assert all(p["decode_batch"] > 0 and p["eager_ms"] > 0 for p in mixed)


def test_mixed_step_forward_equals_its_two_halves_run_apart(torch_python: str) -> None:
    """The mixed forward is the chunk's forward and the decode batch's, in one pass: same logits,
    same KV written (checked in the torch venv, which this process lacks)."""
    code = """
import torch
from bench.gpu_attention import Shape
from bench.gpu_engine_steps import EngineLlama
from bench.gpu_mixed_steps import forward_mixed
from bench.gpu_points import TINY
m = EngineLlama(Shape.from_hf(TINY), torch.device("cpu"), 2000)
chunk, dec = torch.randint(0, 1000, (1, 16)), torch.randint(0, 1000, (3, 1))
cc, dc = m.new_cache(1, 80), m.new_cache(3, 129)
cc2, dc2 = [(a.clone(), b.clone()) for a, b in cc], [(a.clone(), b.clone()) for a, b in dc]
with torch.inference_mode():
    mixed = forward_mixed(m, chunk, 64, cc, dec, 128, dc)
    apart = torch.cat([m.forward(chunk, 64, cc2), m.forward(dec, 128, dc2)])
same_kv = all(torch.equal(x, y) for p, q in zip(cc + dc, cc2 + dc2) for x, y in zip(p, q))
print(float((mixed.float() - apart.float()).abs().max()), same_kv, tuple(mixed.shape))
"""
    done = subprocess.run(
        [torch_python, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    err, same_kv, shape = done.stdout.split(maxsplit=2)
    assert float(err) < 1e-2 and same_kv == "True" and shape.strip() == "(4, 1024)"


def test_kv_copy_checks_its_page_placement_and_reports_rates(torch_python: str, tmp_path: Path):
    data = _run(torch_python, "bench.gpu_kv_copy", tmp_path / "k.json")
    cases = {r["case"] for r in data["rows"]}
    assert cases == {"bulk", "layer_first", "paged", "staged_scatter", "pageable_bulk",
                     "offload_bulk"}  # fmt: skip
    assert all(r["gb_per_s"] > 0 and r["bytes"] == r["tokens"] * 2 * 2 * 8 * 128 * 2
               for r in data["rows"])  # fmt: skip


def test_engine_steps_still_run(torch_python: str, tmp_path: Path) -> None:
    data = _run(torch_python, "bench.gpu_engine_steps", tmp_path / "e.json")
    assert [p["kind"] for p in data["points"]] == ["prefill", "prefill", "decode"]
