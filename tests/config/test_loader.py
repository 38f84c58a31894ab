"""config.loader: defaults and the bundled examples, environment and code overrides (a bad one
names its variable), immutability and the dict round trip. Mistakes in a file:
test_config_errors.py."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config import (
    AdmissionMode,
    ConfigError,
    PDProtocol,
    Role,
    Settings,
    example_names,
    example_path,
    load_settings,
    settings_from_dict,
    settings_to_dict,
    validate_settings,
)
from config.coerce import freeze
from config.overrides import parse_env_value
from tests.config.support import POOLS, WriteToml, load_error

# --- defaults and examples -------------------------------------------------------------------


def test_defaults_load_without_file_and_with_empty_env() -> None:
    settings = load_settings(None, env={})
    assert settings == Settings()
    assert settings.pools == ()
    assert settings.admission.mode is AdmissionMode.PREDICTIVE


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE__SLO__TTFT_S", "7")
    assert load_settings().slo.ttft_s == 7.0


def test_bundled_examples_are_present() -> None:
    assert {"pd-vllm", "pd-sglang", "colocated", "trace-sim"} <= set(example_names())
    assert example_path("pd-vllm") == example_path("pd-vllm.toml")
    with pytest.raises(FileNotFoundError, match="pd-vllm"):
        example_path("no-such-example")


@pytest.mark.parametrize("name", example_names())
def test_every_example_loads_and_round_trips(name: str) -> None:
    settings = load_settings(example_path(name), env={})
    assert settings.instances()
    assert settings_from_dict(settings_to_dict(settings)) == settings


def test_pd_vllm_example_contents() -> None:
    s = load_settings(example_path("pd-vllm"), env={})
    roles = [i.role for i in s.instances()]
    assert roles == [Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE]
    assert [i.url for i in s.instances()] == [f"http://127.0.0.1:{p}" for p in range(8101, 8105)]
    assert {i.protocol for i in s.instances()} == {PDProtocol.VLLM}
    assert s.routing.policy == "kvcache_centric"
    assert s.admission.mode is AdmissionMode.PREDICTIVE


def test_pd_sglang_colocated_and_trace_sim_examples() -> None:
    sglang = load_settings(example_path("pd-sglang"), env={})
    assert {i.protocol for i in sglang.instances()} == {PDProtocol.SGLANG}
    assert all(i.bootstrap_port for i in sglang.instances() if i.role is Role.PREFILL)

    colocated = load_settings(example_path("colocated"), env={})
    assert [i.role for i in colocated.instances()] == [Role.BOTH] * 4

    sim = load_settings(example_path("trace-sim"), env={})
    assert sim.routing.block_size == 512
    assert (sim.slo.ttft_s, sim.slo.tbt_s) == (30.0, 0.1)
    assert sim.predictors.profile == "llama2-70b-a100-tp8"


# --- environment and code overrides ------------------------------------------------------------


def test_env_override_beats_file(write_toml: WriteToml) -> None:
    path = write_toml('[slo]\nttft_s = 2\n[admission]\nmode = "none"\n')
    env = {
        "KVGATE__SLO__TTFT_S": "5",
        "kvgate__Admission__Mode": "early",  # the key path is case-insensitive
        "KVGATE__REPLICATION__ENABLED": "false",
        "KVGATE_UNRELATED": "ignored",
    }
    settings = load_settings(path, env=env)
    assert settings.slo.ttft_s == 5.0
    assert settings.admission.mode is AdmissionMode.EARLY
    assert settings.replication.enabled is False


def test_env_reaches_into_arrays_and_keeps_numeric_strings(write_toml: WriteToml) -> None:
    env = {
        "KVGATE__POOLS__1__INSTANCES__0__MAX_BATCH": "64",
        "KVGATE__SERVER__ADMIN_TOKEN": "12345678",  # parses as an int, but the field is str
        "KVGATE__ROUTING__POLICY": "dynamo_kv",
        "KVGATE__ROUTING__PARAMS__ROUTER_TEMPERATURE": "0.25",
    }
    settings = load_settings(write_toml(POOLS), env=env)
    assert settings.pools[1].instances[0].max_batch == 64
    assert settings.server.admin_token == "12345678"
    assert settings.routing.params == {"router_temperature": 0.25}


def test_empty_env_value_restores_the_default(write_toml: WriteToml) -> None:
    path = write_toml('[server]\nadmin_token = "abcdefgh"\n')
    settings = load_settings(path, env={"KVGATE__SERVER__ADMIN_TOKEN": ""})
    assert settings.server.admin_token is None


def test_bad_env_value_names_the_variable(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nttft_s = 2\n")
    err = load_error(path, env={"KVGATE__SLO__TTFT_S": "soon"})
    assert err.source == "env KVGATE__SLO__TTFT_S"
    assert err.key == "slo.ttft_s"
    assert str(err) == 'env KVGATE__SLO__TTFT_S: slo.ttft_s = "soon": must be a number, got string'

    err = load_error(path, env={"KVGATE__SLO__TTFT_S": "-5"})
    assert str(err) == "env KVGATE__SLO__TTFT_S: slo.ttft_s = -5: must be > 0"


def test_env_min_max_conflict_is_blamed_on_the_env_var(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nmin_ttft_s = 5\n")
    err = load_error(path, env={"KVGATE__SLO__MAX_TTFT_S": "1"})
    assert (err.source, err.key) == ("env KVGATE__SLO__MAX_TTFT_S", "slo.max_ttft_s")


@pytest.mark.parametrize(
    ("name", "key", "fragment"),
    [
        ("KVGATE__SLO__TTFT", "slo.ttft", 'did you mean "ttft_s"'),
        ("KVGATE__SLO__TTFT_S__X", "slo.ttft_s.x", "not a table"),
        ("KVGATE__POOLS__7__NAME", "pools[7].name", "out of range"),
        ("KVGATE__SLO____TTFT_S", "slo..ttft_s", "empty key segment"),
    ],
)
def test_bad_env_key_names_the_variable(
    write_toml: WriteToml, name: str, key: str, fragment: str
) -> None:
    err = load_error(write_toml(POOLS + "[slo]\nttft_s = 2\n"), env={name: "1"})
    assert err.source == f"env {name}"
    assert err.key == key
    assert fragment in str(err) and str(err).startswith(f"env {name}: ")


def test_table_created_by_env_is_blamed_on_the_variable() -> None:
    # No [slo] in the "file": the variable creates slo.ttft_s as a table, which is wrong.
    err = load_error(None, env={"KVGATE__SLO__TTFT_S__X": "1"})
    assert (err.source, err.key) == ("env KVGATE__SLO__TTFT_S__X", "slo.ttft_s")
    assert "must be a number, got table" in str(err)


def test_overrides_beat_env_and_accept_dotted_keys() -> None:
    env = {"KVGATE__SLO__TTFT_S": "5"}
    settings = load_settings(env=env, overrides={"slo.ttft_s": 9, "routing": {"seed": 3}})
    assert (settings.slo.ttft_s, settings.routing.seed) == (9.0, 3)
    with pytest.raises(ConfigError) as info:
        load_settings(env=env, overrides={"slo": {"ttft_s": 0}})
    assert (info.value.source, info.value.key) == ("<overrides>", "slo.ttft_s")


def test_parse_env_value_types() -> None:
    assert parse_env_value("5") == 5
    assert parse_env_value("0.5") == 0.5
    assert parse_env_value("true") is True
    assert parse_env_value('"quoted"') == "quoted"
    assert parse_env_value("early") == "early"
    assert parse_env_value("[1, 2]") == "[1, 2]"  # only scalars are typed
    assert parse_env_value("1\nx = 2") == "1\nx = 2"


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_parse_env_value_integers(value: int) -> None:
    assert parse_env_value(str(value)) == value


@given(st.text())
def test_parse_env_value_never_raises(raw: str) -> None:
    assert isinstance(parse_env_value(raw), bool | int | float | str)


# --- immutability, dict round trip, live validation --------------------------------------------


def test_settings_are_frozen(write_toml: WriteToml) -> None:
    routing = '[routing]\npolicy = "sglang_cache_aware"\n[routing.params]\ncache_threshold = 0.5\n'
    toml = POOLS + routing
    settings = load_settings(write_toml(toml), env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.slo.ttft_s = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.pools[0].instances[0].url = "http://x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.routing.params["cache_threshold"] = 3  # type: ignore[index]
    assert freeze({"w": [1, [2]]})["w"] == (1, (2,))  # nested arrays are frozen too


def test_round_trip_through_dict_and_json() -> None:
    settings = load_settings(
        example_path("pd-vllm"),
        env={
            "KVGATE__SERVER__ADMIN_TOKEN": "tok-123456",
            "KVGATE__ROUTING__POLICY": "sglang_cache_aware",
            "KVGATE__ROUTING__PARAMS__BALANCE_ABS_THRESHOLD": "2",
        },
    )
    plain = settings_to_dict(settings)
    assert plain["admission"]["mode"] == "predictive"
    assert plain["routing"]["predict_on_route_ttl_s"] == 120.0  # finite by default
    assert settings_from_dict(plain) == settings
    assert settings_from_dict(json.loads(json.dumps(plain))) == settings


def test_settings_from_dict_validates_like_the_file_loader() -> None:
    data = {"pools": [{"name": "p", "role": "both", "instances": [{"id": "a", "url": "x"}]}]}
    with pytest.raises(ConfigError) as info:
        settings_from_dict(data)
    assert str(info.value) == (
        '<dict>: pools[0].instances[0].url = "x": must be an http:// or https:// URL with a host'
    )


def test_validate_settings_catches_bad_replace() -> None:
    bad = dataclasses.replace(Settings(), server=dataclasses.replace(Settings().server, port=0))
    with pytest.raises(ConfigError, match=r"server\.port = 0"):
        validate_settings(bad)


def test_config_error_pickles_with_all_errors(write_toml: WriteToml) -> None:
    err = load_error(write_toml("[slo]\nttft_s = -1\ntbt_s = -1\n"))
    copy = pickle.loads(pickle.dumps(err))
    assert copy.errors == err.errors and str(copy) == str(err)
