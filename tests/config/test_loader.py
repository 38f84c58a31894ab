"""Tests for config.loader: every kind of mistake names its file (or env var) and key path."""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from config import (
    AdmissionMode,
    ConfigError,
    Protocol,
    ReplicationSink,
    Role,
    Settings,
    example_names,
    example_path,
    load_settings,
    settings_from_dict,
    settings_to_dict,
    validate_settings,
)
from config.overrides import parse_env_value

WriteToml = Callable[[str], Path]

POOLS = """
[[pools]]
name = "prefill"
role = "prefill"

[[pools.instances]]
id = "p0"
url = "http://127.0.0.1:8101"

[[pools]]
name = "decode"
role = "decode"

[[pools.instances]]
id = "d0"
url = "http://127.0.0.1:8102"
"""


@pytest.fixture
def write_toml(tmp_path: Path) -> WriteToml:
    def write(text: str) -> Path:
        path = tmp_path / "kvgate.toml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


def load_error(path: Path | None, env: Mapping[str, str] | None = None, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(path, env=env or {}, **kw)
    return info.value


def assert_names(err: ConfigError, path: Path, key: str) -> None:
    """The first error is about ``key`` in ``path``, and the message says so."""
    assert err.source == str(path)
    assert err.key == key
    first_line = str(err).splitlines()[0]
    assert first_line.startswith(f"{path}: {key}")


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
    assert {i.protocol for i in s.instances()} == {Protocol.VLLM}
    assert s.routing.policy == "kvcache_centric"
    assert s.admission.mode is AdmissionMode.PREDICTIVE


def test_pd_sglang_colocated_and_trace_sim_examples() -> None:
    sglang = load_settings(example_path("pd-sglang"), env={})
    assert {i.protocol for i in sglang.instances()} == {Protocol.SGLANG}
    assert all(i.bootstrap_port for i in sglang.instances() if i.role is Role.PREFILL)

    colocated = load_settings(example_path("colocated"), env={})
    assert [i.role for i in colocated.instances()] == [Role.BOTH] * 4

    sim = load_settings(example_path("trace-sim"), env={})
    assert sim.routing.block_size == 512
    assert (sim.slo.ttft_s, sim.slo.tbt_s) == (30.0, 0.1)
    assert sim.predictors.profile == "llama2-70b-a100-tp8"


# --- one test per kind of mistake ------------------------------------------------------------


def test_syntax_error_names_file_line_and_column(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nttft_s = 1\ntbt_s = = 2\n")
    err = load_error(path)
    assert err.source == str(path)
    assert str(err).startswith(f"{path}: invalid TOML")
    assert "line 3" in str(err) and "column" in str(err)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    err = load_error(path)
    assert err.source == str(path)
    assert "cannot read config file" in str(err)


def test_unknown_key_suggests_the_closest_name(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nttft = 5\n")
    err = load_error(path)
    assert_names(err, path, "slo.ttft")
    assert 'did you mean "ttft_s"?' in str(err)


def test_unknown_section_lists_valid_keys_when_nothing_is_close(write_toml: WriteToml) -> None:
    path = write_toml("[zzz]\na = 1\n")
    err = load_error(path)
    assert_names(err, path, "zzz")
    assert "valid keys:" in str(err) and "routing" in str(err)


def test_wrong_type_names_expected_and_actual(write_toml: WriteToml) -> None:
    path = write_toml('[slo]\ntbt_s = "fast"\n')
    err = load_error(path)
    assert_names(err, path, "slo.tbt_s")
    assert str(err) == f'{path}: slo.tbt_s = "fast": must be a number, got string'


def test_bool_is_not_a_number(write_toml: WriteToml) -> None:
    path = write_toml("[routing]\nblock_size = true\n")
    err = load_error(path)
    assert_names(err, path, "routing.block_size")
    assert "must be an integer, got boolean" in str(err)
    path = write_toml("[slo]\nttft_s = false\n")
    err = load_error(path)
    assert_names(err, path, "slo.ttft_s")
    assert "must be a number, got boolean" in str(err)


def test_int_is_accepted_for_float_and_float_rejected_for_int(write_toml: WriteToml) -> None:
    settings = load_settings(write_toml("[slo]\nttft_s = 5\n"), env={})
    assert settings.slo.ttft_s == 5.0 and isinstance(settings.slo.ttft_s, float)
    path = write_toml("[routing]\nblock_size = 16.0\n")
    assert_names(load_error(path), path, "routing.block_size")


def test_non_finite_float_is_rejected(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nmax_ttft_s = nan\n")
    err = load_error(path)
    assert_names(err, path, "slo.max_ttft_s")
    assert "finite" in err.message


def test_bad_enum_lists_allowed_values(write_toml: WriteToml) -> None:
    path = write_toml('[admission]\nmode = "eager"\n')
    err = load_error(path)
    assert_names(err, path, "admission.mode")
    assert '"none", "early", "predictive"' in str(err)


def test_enum_values_are_case_insensitive(write_toml: WriteToml) -> None:
    settings = load_settings(write_toml('[replication]\nsink = "ENGINE"\n'), env={})
    assert settings.replication.sink is ReplicationSink.ENGINE


def test_negative_slo_reads_like_the_documented_format(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nttft_s = -1\n")
    err = load_error(path)
    assert str(err) == f"{path}: slo.ttft_s = -1: must be > 0"
    assert (err.key, err.value, err.message) == ("slo.ttft_s", -1.0, "must be > 0")


def test_min_greater_than_max(write_toml: WriteToml) -> None:
    path = write_toml("[slo]\nmin_tbt_s = 0.5\nmax_tbt_s = 0.2\n")
    err = load_error(path)
    assert_names(err, path, "slo.min_tbt_s")
    assert "must be <= slo.max_tbt_s (0.2)" in str(err)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[routing]\nblock_size = 0", "routing.block_size"),
        ("[routing]\nblock_size = 8192", "routing.block_size"),
        ("[routing]\nkvcache_balancing_threshold = 0.5", "routing.kvcache_balancing_threshold"),
        ("[predictors]\noutput_length_quantile = 1.0", "predictors.output_length_quantile"),
        ("[server]\nport = 0", "server.port"),
        ("[replication]\nmax_replicas = 0", "replication.max_replicas"),
        ("[replication]\nmax_in_flight = 1", "replication.max_in_flight_per_destination"),
        ('[slo]\ndefault_priority = "urgent"', "slo.default_priority"),
        ('[[slo.priorities]]\nname = "a"\nlevel = 1\nheadroom = 1.5', "slo.priorities[0].headroom"),
    ],
)
def test_range_checks(write_toml: WriteToml, text: str, key: str) -> None:
    path = write_toml(text + "\n")
    assert_names(load_error(path), path, key)


def test_duplicate_priority_names_and_levels(write_toml: WriteToml) -> None:
    path = write_toml(
        '[slo]\ndefault_priority = "a"\n'
        '[[slo.priorities]]\nname = "a"\nlevel = 1\n'
        '[[slo.priorities]]\nname = "a"\nlevel = 1\n'
    )
    err = load_error(path)
    keys = [e.key for e in err.errors]
    assert keys == ["slo.priorities[1].name", "slo.priorities[1].level"]
    assert "also at slo.priorities[0].name" in str(err)


def test_duplicate_instance_id_across_pools(write_toml: WriteToml) -> None:
    path = write_toml(POOLS.replace('id = "d0"', 'id = "p0"'))
    err = load_error(path)
    assert_names(err, path, "pools[1].instances[0].id")
    assert "duplicate instance id (also at pools[0].instances[0].id)" in str(err)


def test_duplicate_pool_name(write_toml: WriteToml) -> None:
    path = write_toml(POOLS.replace('name = "decode"', 'name = "prefill"'))
    assert_names(load_error(path), path, "pools[1].name")


@pytest.mark.parametrize(
    "url", ["127.0.0.1:8101", "ftp://127.0.0.1", "http://", "http://h:99999", "http://h:0"]
)
def test_bad_url(write_toml: WriteToml, url: str) -> None:
    path = write_toml(POOLS.replace("http://127.0.0.1:8101", url))
    err = load_error(path)
    assert_names(err, path, "pools[0].instances[0].url")


def test_missing_required_field(write_toml: WriteToml) -> None:
    path = write_toml(POOLS.replace('url = "http://127.0.0.1:8102"\n', ""))
    err = load_error(path)
    assert_names(err, path, "pools[1].instances[0].url")
    assert str(err) == f"{path}: pools[1].instances[0].url: missing required key"


def test_instance_inherits_pool_role_and_mismatch_is_rejected(write_toml: WriteToml) -> None:
    settings = load_settings(write_toml(POOLS), env={})
    assert [i.role for i in settings.instances()] == [Role.PREFILL, Role.DECODE]
    path = write_toml(POOLS.replace('id = "d0"', 'id = "d0"\nrole = "prefill"'))
    err = load_error(path)
    assert_names(err, path, "pools[1].instances[0].role")
    assert 'pool\'s role "decode"' in str(err)


def test_prefill_without_decode_is_rejected(write_toml: WriteToml) -> None:
    path = write_toml(POOLS.split('[[pools]]\nname = "decode"')[0])
    err = load_error(path)
    assert_names(err, path, "pools")
    assert "no decode instance" in str(err)


def test_bootstrap_port_requires_sglang(write_toml: WriteToml) -> None:
    path = write_toml(POOLS.replace('id = "p0"', 'id = "p0"\nbootstrap_port = 8998'))
    assert_names(load_error(path), path, "pools[0].instances[0].bootstrap_port")


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ('kv_events_endpoint = "tcp://5557"', "kv_events_endpoint"),  # no host
        ('kv_events_endpoint = "tcp://*:kv"', "kv_events_endpoint"),  # no port
        ('kv_events_endpoint = "http://127.0.0.1:5557"', "kv_events_endpoint"),
        ("kv_events_bind = true", "kv_events_bind"),  # nothing to bind
    ],
)
def test_kv_events_endpoint_and_bind_are_checked(
    write_toml: WriteToml, fields: str, key: str
) -> None:
    path = write_toml(POOLS.replace('id = "p0"', f'id = "p0"\n{fields}'))
    assert_names(load_error(path), path, f"pools[0].instances[0].{key}")


def test_kv_events_endpoint_forms_and_bind_override_load(write_toml: WriteToml) -> None:
    for endpoint in ("tcp://*:5557", "tcp://10.0.0.2:5557", "ipc:///run/v.sock"):
        fields = f'kv_events_endpoint = "{endpoint}"\nkv_events_bind = false'
        path = write_toml(POOLS.replace('id = "p0"', f'id = "p0"\n{fields}'))
        (p0, _) = load_settings(path).instances()
        assert (p0.kv_events_endpoint, p0.kv_events_bind) == (endpoint, False)


def test_all_errors_are_collected_one_per_line(write_toml: WriteToml) -> None:
    path = write_toml('[slo]\nttft_s = "x"\ntbt = 1\n[admission]\nmode = "bad"\n')
    err = load_error(path)
    assert [e.key for e in err.errors] == ["slo.ttft_s", "slo.tbt", "admission.mode"]
    lines = str(err).splitlines()
    assert len(lines) == 3 and all(line.startswith(f"{path}: ") for line in lines)


def test_admin_token_value_is_never_shown(write_toml: WriteToml) -> None:
    path = write_toml('[server]\nadmin_token = "s3cret token"\n')
    err = load_error(path)
    assert_names(err, path, "server.admin_token")
    assert "s3cret" not in str(err)


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
        "KVGATE__ROUTING__PARAMS__ALPHA": "0.25",
    }
    settings = load_settings(write_toml(POOLS), env=env)
    assert settings.pools[1].instances[0].max_batch == 64
    assert settings.server.admin_token == "12345678"
    assert settings.routing.params == {"alpha": 0.25}


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
    settings = load_settings(write_toml(POOLS + "[routing.params]\nw = [1, 2]\n"), env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.slo.ttft_s = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.pools[0].instances[0].url = "http://x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.routing.params["w"] = 3  # type: ignore[index]
    assert settings.routing.params["w"] == (1, 2)  # nested arrays are frozen too


def test_round_trip_through_dict_and_json() -> None:
    settings = load_settings(
        example_path("pd-vllm"),
        env={"KVGATE__SERVER__ADMIN_TOKEN": "tok-123456", "KVGATE__ROUTING__PARAMS__K": "2"},
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
