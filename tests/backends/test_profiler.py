"""The profiling sweep against kvgate's emulator (in-process, time-scaled) and its parsing."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from backends.profile_cli import main as profile_main
from backends.profile_file import load_profile_file
from backends.profile_plan import SweepPlan
from backends.profiler import EngineProfiler, ProfileError, _Timing, _usage, decode_samples
from gateway.cli import build_parser
from predictors.calibration import fit_profile
from predictors.profiles import get_profile
from replay.emulator import EmulatorConfig, start_emulator
from replay.engine.timing import StepTiming

PROFILE = "llama2-70b-a100-tp8-2023"  # 44 ms fixed + 0.16 ms/token: HTTP overhead is small
SCALE = 0.5
TIMING = StepTiming.from_profile(get_profile(PROFILE))
OVERHEAD_MS = 8.0  # client-side HTTP + event loop, wall ms
PLAN = SweepPlan(
    prompt_tokens=(64, 256, 1024, 2048),
    cached_fractions=(0.0, 0.5),
    batch_sizes=(1, 2, 4),
    decode_contexts=(256,),
    repeats=1,
    decode_tokens=12,
    max_seconds=60,
    max_requests=100,
)


def test_sweep_against_emulator_recovers_its_step_model() -> None:
    async def main():
        emu = await start_emulator(EmulatorConfig(profile=PROFILE, time_scale=SCALE))
        try:
            async with aiohttp.ClientSession() as session:
                return await EngineProfiler(session, emu.url, PROFILE, PLAN).run()
        finally:
            await emu.stop()

    result = asyncio.run(main())
    assert result.errors == 0 and result.token_ids and not result.stopped_early
    cal = fit_profile(result.samples, name="emu", model=PROFILE)
    # The emulator reports cached tokens (block-aligned) in usage: partly cached samples exist.
    assert any(s.cached_tokens > 0 for s in result.samples if s.batch == 0)
    chunk = get_profile(PROFILE).max_batched_tokens
    for n, c in ((64, 0), (256, 0), (1024, 0), (2048, 0), (512, 512), (128, 896)):
        modeled_ms = TIMING.prefill(n, c, chunk) * SCALE * 1000
        predicted_ms = cal.profile.prefill.gpu_ms(n, c)
        # Above the model by the HTTP and event-loop overhead a client sees (a few ms on a
        # busy 2-core machine), never well below it.
        assert modeled_ms * 0.9 <= predicted_ms <= modeled_ms * 1.15 + OVERHEAD_MS, (n, c)
    assert cal.quality.decode_samples >= 3
    for batch in (1, 2, 4):
        k = batch * 260
        modeled_ms = TIMING.step(batch, 0.0, k) * SCALE * 1000
        predicted_ms = cal.profile.decode.gpu_ms(batch, k)
        assert modeled_ms * 0.85 <= predicted_ms <= modeled_ms * 1.15 + OVERHEAD_MS, batch


def test_profile_cli_writes_a_profile_the_gateway_loads(tmp_path: Path, capsys) -> None:
    out = tmp_path / "engine.json"

    async def main() -> int:
        emu = await start_emulator(EmulatorConfig(profile=PROFILE, time_scale=0.05))
        argv = ["profile", "--target", emu.url, "--model", PROFILE, "--out", str(out)]
        argv += ["--prompt-tokens", "64,512,1024", "--cached-fractions", "0,0.5"]
        argv += ["--batch-sizes", "1,2", "--decode-contexts", "128", "--repeats", "1", "--quiet"]
        args = build_parser().parse_args(argv)
        try:
            return await asyncio.to_thread(profile_main, args)
        finally:
            await emu.stop()

    assert asyncio.run(main()) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["errors"] == 0
    assert summary["prefill"]["samples"] >= 4
    cal = load_profile_file(out)
    assert cal.profile.name == f"{PROFILE}-measured"
    assert cal.profile.prefill.b_ms > 0


def test_profile_cli_unreachable_engine_exits_2(tmp_path: Path, capsys) -> None:
    argv = ["profile", "--target", "http://127.0.0.1:9", "--model", "m"]
    argv += ["--out", str(tmp_path / "x.json"), "--quiet"]
    assert profile_main(build_parser().parse_args(argv)) == 2
    assert "did not answer" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_profile_cli_rejects_bad_bounds(tmp_path: Path, capsys) -> None:
    argv = ["profile", "--target", "http://127.0.0.1:9", "--model", "m", "--out", "x.json"]
    args = build_parser().parse_args([*argv, "--max-prompt-tokens", "10"])
    assert profile_main(args) == 2
    assert "--max-prompt-tokens" in capsys.readouterr().err


def test_profile_help_lists_the_sweep_options(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["profile", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--target", "--model", "--out", "--cached-fractions", "--batch-sizes"):
        assert option in text


def test_usage_reads_openai_usage_and_llamacpp_timings() -> None:
    vllm = {
        "choices": [],
        "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}},
    }
    assert _usage(vllm, None, None) == (100, 64)
    llama = {
        "choices": [{"text": "", "finish_reason": "length"}],
        "timings": {"cache_n": 50, "prompt_n": 7},
    }
    assert _usage(llama, None, None) == (57, 50)
    assert _usage({"choices": [{"text": "x"}]}, 5, 1) == (5, 1)


def test_decode_samples_step_time_and_batch_from_overlapping_streams() -> None:
    # Two streams decoding together every 10 ms; a third case alone every 6 ms.
    pair = tuple(0.1 + 0.01 * i for i in range(10))
    alone = tuple(1.0 + 0.006 * i for i in range(10))
    samples = decode_samples([_Timing(pair, None, None), _Timing(pair, None, None)], 100)
    samples += decode_samples([_Timing(alone, None, None)], 100)
    by_batch = {s.batch: s for s in samples}
    assert by_batch[2].seconds == pytest.approx(0.01)
    assert by_batch[1].seconds == pytest.approx(0.006)
    assert by_batch[2].context_tokens > 2 * 100


def test_decode_samples_count_tokens_from_usage_when_chunks_merge() -> None:
    # A lagging server sent 20 tokens in 10 chunks: the step is half the chunk gap.
    chunks = tuple(0.01 * i for i in range(10))
    (sample,) = decode_samples([_Timing(chunks, None, None, completion_tokens=19)], 50)
    assert sample.batch == 1
    assert sample.seconds == pytest.approx(0.09 / 18)


def test_a_stream_read_in_one_burst_is_no_decode_sample() -> None:
    # 32 tokens whose chunks were all read within 0.2 ms: a flushed backlog, not 7 us steps.
    burst = tuple(0.5 + 6e-6 * i for i in range(32))
    paced = tuple(0.5 + 0.002 * i for i in range(32))
    assert decode_samples([_Timing(burst, None, None, completion_tokens=32)], 100) == []
    (sample,) = decode_samples([_Timing(paced, None, None, completion_tokens=32)], 100)
    assert sample.seconds == pytest.approx(0.002)


def test_profiler_raises_when_engine_unreachable() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await EngineProfiler(session, "http://127.0.0.1:9", "m", PLAN).run()

    with pytest.raises(ProfileError, match="did not answer"):
        asyncio.run(main())
