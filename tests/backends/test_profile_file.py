"""Profile files: written atomically, read with errors naming the file and key; the CLI's
`config check` and `serve` refuse a bad one with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.predictor_files import predictor_factory
from backends.profile_file import (
    ProfileFileError,
    load_measured_profiles,
    load_profile_file,
    write_profile_file,
)
from config.settings import PredictorSettings
from gateway.cli import main as cli_main
from predictors.calibration import SweepSample, fit_profile


def measured_file(path: Path) -> Path:
    samples = [
        SweepSample(new_tokens=n, cached_tokens=c, seconds=0.01 + 0.0001 * n + 1e-8 * n * c)
        for n in (64, 256, 1024, 2048)
        for c in (0, 512)
    ]
    write_profile_file(path, fit_profile(samples, name="mine", model="tiny"))
    return path


def config_with(tmp_path: Path, profile_file: Path) -> Path:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(
        f'[predictors]\nprofile_file = "{profile_file}"\n\n'
        '[[pools]]\nname = "p"\nrole = "both"\n'
        '[[pools.instances]]\nid = "e0"\nurl = "http://127.0.0.1:18599"\n'
    )
    return cfg


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    cal = load_profile_file(measured_file(tmp_path / "p.json"))
    assert cal.profile.name == "mine" and len(cal.prefill_samples) == 8
    assert not list(tmp_path.glob(".*.tmp"))


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileFileError, match=r"nope\.json: cannot read profile file"):
        load_profile_file(tmp_path / "nope.json")


def test_invalid_json_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileFileError, match=r"bad\.json: profile file is not valid JSON"):
        load_profile_file(bad)


def test_bad_value_names_file_and_key(tmp_path: Path) -> None:
    path = measured_file(tmp_path / "p.json")
    data = json.loads(path.read_text())
    data["prefill"]["b_ms"] = "slow"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFileError) as info:
        load_profile_file(path)
    assert str(info.value).startswith(f"{path}: key 'prefill.b_ms': must be a number")


def test_config_check_and_serve_exit_2_on_a_bad_profile_file(tmp_path: Path, capsys) -> None:
    path = measured_file(tmp_path / "p.json")
    cfg = config_with(tmp_path, path)
    assert cli_main(["config", "check", str(cfg)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    del data["decode"]["k_ms"]
    path.write_text(json.dumps(data))
    assert cli_main(["config", "check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'decode.k_ms': is missing" in err
    assert cli_main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "'decode.k_ms'" in err and "Traceback" not in err


def test_empty_profile_file_setting_is_a_config_error(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text('[predictors]\nprofile_file = ""\n')
    assert cli_main(["config", "check", str(cfg)]) == 2
    assert "predictors.profile_file" in capsys.readouterr().err


def named_file(path: Path, name: str, per_token_s: float) -> Path:
    samples = [
        SweepSample(new_tokens=n, cached_tokens=0, seconds=0.005 + per_token_s * n)
        for n in (64, 256, 1024, 2048)
    ]
    write_profile_file(path, fit_profile(samples, name=name, model="tiny"))
    return path


def test_profile_files_are_chosen_by_name_per_instance_or_model(tmp_path: Path) -> None:
    settings = PredictorSettings(
        profile_file=str(named_file(tmp_path / "a.json", "vllm-cpu", 1e-4)),
        profile_files=(str(named_file(tmp_path / "b.json", "llama-cpu", 1e-3)),),
    )
    measured = load_measured_profiles(settings)
    factory = predictor_factory(settings, measured)
    assert factory is not None
    assert factory(None).profile.name == "vllm-cpu"  # the default for unnamed instances
    assert factory("llama-cpu").profile.name == "llama-cpu"
    assert factory("llama-cpu").prefill.predict(1024, 0) > 5 * factory(None).prefill.predict(
        1024, 0
    )
    assert factory("llama3-8b-h100-tp1").profile.name == "llama3-8b-h100-tp1"
    assert set(measured.prior()) == {None, "vllm-cpu", "llama-cpu"}


def test_two_files_with_one_profile_name_are_refused(tmp_path: Path) -> None:
    settings = PredictorSettings(
        profile_file=str(named_file(tmp_path / "a.json", "same", 1e-4)),
        profile_files=(str(named_file(tmp_path / "b.json", "same", 1e-3)),),
    )
    with pytest.raises(ProfileFileError, match=r"b\.json: key 'name': profile 'same'"):
        load_measured_profiles(settings)
