"""config.loader, one test per kind of mistake: each names its file and key path (and the value,
never a secret)."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import (
    ReplicationSink,
    Role,
    load_settings,
)
from tests.config.support import POOLS, WriteToml, assert_names, load_error


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
        ("[routing]\ntokenize_offload_chars = -1", "routing.tokenize_offload_chars"),
        ("[predictors]\noutput_length_quantile = 1.0", "predictors.output_length_quantile"),
        ("[server]\nport = 0", "server.port"),
        ("[replication]\nmax_replicas = 0", "replication.max_replicas"),
        ("[replication]\nmax_in_flight = 1", "replication.max_in_flight_per_destination"),
        ('[slo]\ndefault_priority = "urgent"', "slo.default_priority"),
        ('[[slo.priorities]]\nname = "a"\nlevel = 1\nheadroom = 1.5', "slo.priorities[0].headroom"),
        ("[admission.best_effort]\nidle_share = 1.5", "admission.best_effort.idle_share"),
        ("[admission.best_effort]\nmax_decode_load = 1.5", "admission.best_effort.max_decode_load"),
        ("[admission.doomed_warmup]\nmin_idle = 0", "admission.doomed_warmup.min_idle"),
        (
            "[admission.doomed_warmup]\nmax_decode_load = 2",
            "admission.doomed_warmup.max_decode_load",
        ),
        ("[admission.decode_reservation]\nfraction = 1", "admission.decode_reservation.fraction"),
        ("[admission.decode_reservation]\nwindow = 0", "admission.decode_reservation.window"),
        (
            '[[slo.priorities]]\nname = "a"\nlevel = 1\ntbt_headroom = 1.0',
            "slo.priorities[0].tbt_headroom",
        ),
        ("[admission.tbt_headroom]\ntarget_miss = 2", "admission.tbt_headroom.target_miss"),
        ("[admission.tbt_headroom]\nwindow = 0", "admission.tbt_headroom.window"),
        ("[admission.tbt_headroom]\nmin_share = -0.1", "admission.tbt_headroom.min_share"),
        ("[admission.wait_margin]\nmax_factor = 0.5", "admission.wait_margin.max_factor"),
        ("[admission.wait_margin]\nwindow = 0", "admission.wait_margin.window"),
        ("[admission.wait_margin]\nraise_gain = 0", "admission.wait_margin.raise_gain"),
        ("[admission.prefill_stall]\ncredit = 1.5", "admission.prefill_stall.credit"),
        ("[admission.prefill_stall]\nwindow = 0", "admission.prefill_stall.window"),
        ("[admission.prefill_stall]\nlower_factor = 2", "admission.prefill_stall.lower_factor"),
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
        ('kv_events_replay_endpoint = "tcp://*:5558"', "kv_events_replay_endpoint"),  # alone
        (
            'kv_events_endpoint = "tcp://*:5557"\nkv_events_replay_endpoint = "http://h:5558"',
            "kv_events_replay_endpoint",
        ),
    ],
)
def test_kv_events_endpoint_and_bind_are_checked(
    write_toml: WriteToml, fields: str, key: str
) -> None:
    path = write_toml(POOLS.replace('id = "p0"', f'id = "p0"\n{fields}'))
    assert_names(load_error(path), path, f"pools[0].instances[0].{key}")


def test_kv_events_endpoint_forms_and_bind_override_load(write_toml: WriteToml) -> None:
    for endpoint in ("tcp://*:5557", "tcp://10.0.0.2:5557", "ipc:///run/v.sock"):
        fields = (
            f'kv_events_endpoint = "{endpoint}"\nkv_events_bind = false\n'
            'kv_events_replay_endpoint = "tcp://*:5558"'
        )
        path = write_toml(POOLS.replace('id = "p0"', f'id = "p0"\n{fields}'))
        (p0, _) = load_settings(path).instances()
        assert (p0.kv_events_endpoint, p0.kv_events_bind) == (endpoint, False)
        assert p0.kv_events_replay_endpoint == "tcp://*:5558"


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
