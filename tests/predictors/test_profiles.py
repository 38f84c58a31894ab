from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from predictors.profiles import (
    GRID_CONFIGS,
    PROFILES,
    FlopsPrefill,
    get_profile,
    profile_name_for_config,
)

EXPECTED_NAMES = {
    "llama2-7b-h100-tp1", "llama3-8b-h100-tp1", "qwen2.5-7b-h100-tp1",
    "llama2-70b-h100-tp2", "llama2-70b-h100-tp4", "llama2-70b-h100-tp8",
    "llama3-70b-h100-tp4", "llama3-70b-h100-tp8",
    "llama2-7b-a100-tp1", "llama3-8b-a100-tp1", "qwen2.5-7b-a100-tp1",
    "llama2-70b-a100-tp2", "llama2-70b-a100-tp4", "llama2-70b-a100-tp8",
    "llama3-70b-a100-tp4", "llama3-70b-a100-tp8",
}  # fmt: skip


COMPOSED = {n: p for n, p in PROFILES.items() if p.grid_config}


def test_registry_has_all_16_readme_configs() -> None:
    assert set(COMPOSED) == EXPECTED_NAMES
    assert set(PROFILES) - EXPECTED_NAMES == {"llama2-70b-a100-tp8-2023"}
    for name, prof in COMPOSED.items():
        assert prof.name == name
        assert re.fullmatch(r"[a-z0-9.]+-[a-z0-9.]+-(h100|a100)-tp[1248]", name)
        assert GRID_CONFIGS[name] == prof.grid_config == f"{prof.model}/{prof.gpu}/TP{prof.tp}"
        assert profile_name_for_config(prof.grid_config) == name
        assert prof.source and prof.grid_config in prof.source


def test_grid_config_mapping_examples() -> None:
    assert GRID_CONFIGS["llama3-8b-h100-tp1"] == "Llama-3-8B/H100/TP1"
    assert GRID_CONFIGS["llama2-70b-a100-tp8"] == "Llama-2-70B/A100/TP8"
    assert GRID_CONFIGS["qwen2.5-7b-a100-tp1"] == "Qwen2.5-7B/A100/TP1"
    assert profile_name_for_config("Nope/H100/TP1") is None
    assert profile_name_for_config(None) is None


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        PROFILES["x"] = PROFILES["llama3-8b-h100-tp1"]  # type: ignore[index]


def test_get_profile_unknown_lists_known_names() -> None:
    with pytest.raises(KeyError) as exc:
        get_profile("llama3-8b-b200-tp1")
    msg = exc.value.args[0]
    assert "llama3-8b-b200-tp1" in msg
    assert "llama3-8b-h100-tp1" in msg and "llama2-70b-a100-tp8" in msg


def test_coefficients_match_readme_table_llama3_8b_h100() -> None:
    p = get_profile("llama3-8b-h100-tp1")
    # README §4 row (rounded): a=1.99 b=0.02112 n0=256 c=7.42e-07 | a=6.77 b=0.0111 k=4.25e-05
    assert p.prefill.a_ms == pytest.approx(1.99, abs=0.005)
    assert p.prefill.b_ms == pytest.approx(0.02112, rel=1e-3)
    assert p.prefill.n0 == 256
    assert p.prefill.c_ms == pytest.approx(7.42e-7, rel=1e-3)
    assert p.decode.a_ms == pytest.approx(6.77, abs=0.005)
    assert p.decode.b_ms == pytest.approx(0.0111, rel=2e-3)
    assert p.decode.k_ms == pytest.approx(4.25e-5, rel=2e-3)
    assert (p.mixed.a_ms, p.mixed.t0) == (pytest.approx(3.48, abs=0.005), 192)
    assert p.kv_bytes_per_token == 131072
    assert p.kv_capacity_tokens == 430880
    assert (p.max_batch, p.max_batched_tokens) == (1024, 8192)  # vLLM V1 H100 defaults
    assert get_profile("llama3-8b-a100-tp1").max_batch == 256  # A100 defaults
    assert p.overhead_ms == pytest.approx(0.5)


def test_coefficients_equal_fit_results_json(fit_results: Path) -> None:
    data = json.loads(fit_results.read_text())["C_composed"]
    for prof in COMPOSED.values():
        entry = data[prof.grid_config]
        p5, d2, u3 = entry["prefill"]["P5"], entry["decode"]["D2"], entry["mixed"]["U3"]
        assert (prof.prefill.a_ms, prof.prefill.b_ms, prof.prefill.c_ms) == tuple(p5["coef"])
        assert prof.prefill.n0 == p5["knee"]
        assert (prof.decode.a_ms, prof.decode.b_ms, prof.decode.k_ms) == tuple(d2["coef"])
        m = prof.mixed
        assert (m.a_ms, m.b_ms, m.c_ms, m.k_ms) == tuple(u3["coef"]) and m.t0 == u3["knee"]
        assert prof.kv_bytes_per_token == entry["kv_bytes_per_token_bf16"]
        assert prof.kv_capacity_tokens == entry["kv_capacity_tokens_est"]


def test_mixed_u3_reduces_to_prefill_like_step() -> None:
    m = get_profile("llama3-8b-h100-tp1").mixed
    # One 2048-token prefill, nothing decoding: a + b*T + c*attn.
    expected = m.a_ms + m.b_ms * 2048 + m.c_ms * 2048 * 1024
    assert m.gpu_ms(2048, 2048 * 1024, 0) == pytest.approx(expected)
    assert m.gpu_ms(10, 0, 0) == pytest.approx(m.a_ms + m.b_ms * m.t0)  # below the knee


def test_flops_formula() -> None:
    f = FlopsPrefill(effective_flops_per_s=1.0)
    n, d = 1000, 8192
    assert f.flops(n) == pytest.approx(80 * (4 * n * n * d + 22 * n * d * d))
    # New tokens behind a cache: flops(n+c) - flops(c).
    assert f.predict(100, 900) == pytest.approx(f.flops(1000) - f.flops(900))


def test_flops_calibrated_to_llama2_70b_a100_tp8_p5_at_8192() -> None:
    f = FlopsPrefill.calibrated()
    p5_s = get_profile("llama2-70b-a100-tp8").prefill.gpu_ms(8192, 0) / 1000.0
    assert f.predict(8192, 0) == pytest.approx(p5_s, rel=1e-12)
    assert p5_s == pytest.approx(0.9035, rel=0.01)
    # A plausible effective rate: 20-100 % of 8x A100 dense bf16 peak (312 TFLOP/s each).
    assert 0.2 < f.effective_flops_per_s / (8 * 312e12) < 1.0
    # Long prompts agree with P5 within ~10-15 %; short ones have no fixed cost in this model.
    p5 = get_profile("llama2-70b-a100-tp8").prefill
    assert f.predict(16384, 0) == pytest.approx(p5.gpu_ms(16384, 0) / 1000, rel=0.15)
    assert f.predict(16, 0) < p5.gpu_ms(16, 0) / 1000


def test_flops_calibration_with_overhead_and_cache_effects() -> None:
    f = FlopsPrefill.calibrated(get_profile("llama2-70b-a100-tp8"), overhead_s=0.01)
    assert f.overhead_s == 0.01
    target = get_profile("llama2-70b-a100-tp8").prefill.gpu_ms(8192, 0) / 1000.0
    assert f.predict(8192, 0) == pytest.approx(target, rel=1e-12)
    assert f.predict(0, 5000) == pytest.approx(0.01)
    # Same prompt, half of it cached: cheaper. Same new tokens behind a longer cache: dearer.
    assert f.predict(4096, 4096) < f.predict(8192, 0)
    assert f.predict(1024, 8192) > f.predict(1024, 0)
    with pytest.raises(ValueError):
        FlopsPrefill.calibrated(overhead_s=5.0)
    with pytest.raises(ValueError):
        FlopsPrefill(effective_flops_per_s=0.0)
    assert math.isfinite(FlopsPrefill.calibrated(get_profile("llama3-8b-h100-tp1")).predict(1, 0))


def test_2023_profile_matches_the_splitwise_end_to_end_fit(fit_results: Path) -> None:
    sw = json.loads(fit_results.read_text())["A_splitwise"]["llama2-70b/a100-80gb/TP8"]
    d2 = sw["decode"]["D2"]["coef"]
    p = get_profile("llama2-70b-a100-tp8-2023")
    assert (p.decode.a_ms, p.decode.b_ms, p.decode.k_ms) == pytest.approx(d2, rel=1e-3)
    # Splitwise's long-prompt prefill slope (0.1689 ms/token for n >= 1024) within 10 %.
    slope = (p.prefill.gpu_ms(8192, 0) - p.prefill.gpu_ms(4096, 0)) / 4096
    assert slope == pytest.approx(sw["prefill"]["P1(n>=1024)"]["coef"][1], rel=0.1)
