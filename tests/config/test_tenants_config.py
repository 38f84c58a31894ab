"""Config ``tenants``: keys files and tenant tables are checked at load (and so at reload),
each mistake named by key, and a keys file's by its path and line."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from config.loader import ConfigError, load_settings, settings_from_dict
from config.tenant_keys import KeyFileError, hash_key, parse_keys, read_key_file

H1, H2 = hash_key("k1"), hash_key("k2")


def _load(tmp_path: Path, tenants: str) -> str:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text("[tenants]\n" + tenants)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    return str(err.value)


def test_hash_is_sha256_hex() -> None:
    assert hash_key("sk-test") == hashlib.sha256(b"sk-test").hexdigest()
    assert len(H1) == 64 and H1 != H2


def test_keys_file_parses_comments_and_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# team keys\n\na {H1}  # laptop\nb {H2.upper()}\n")
    assert read_key_file(str(f), {"a", "b"}) == {H1: "a", H2: "b"}


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        (f"a {H1}\na\n", 2, "expected 'TENANT SHA256HEX'"),
        (f"a {H1}\n\na sk-plain-key\n", 3, "SHA-256"),
        (f"a {H1}\nb {H1}\n", 2, "duplicate key (also on line 1)"),
        (f"zed {H1}\n", 1, "tenant 'zed' is not defined"),
    ],
)
def test_bad_keys_file_names_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(KeyFileError) as err:
        parse_keys(text, "/etc/kvgate/keys", {"a", "b"})
    assert err.value.line == line
    assert f"keys file /etc/kvgate/keys, line {line}: " in str(err.value)
    assert words in str(err.value)


def test_config_error_for_a_bad_keys_file_names_file_and_line(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"a {H1}\na {H1[:10]}\n")
    msg = _load(tmp_path, f'enabled = true\nkeys_file = "{keys}"\n[[tenants.tenant]]\nname = "a"\n')
    assert "tenants.keys_file" in msg and f"keys file {keys}, line 2" in msg
    missing = _load(tmp_path, 'keys_file = "/nonexistent/keys"\n')
    assert "keys file /nonexistent/keys: cannot read" in missing


@pytest.mark.parametrize(
    ("tenants", "key", "words"),
    [
        ("enabled = true\n", "tenants.tenant", "at least one tenant"),
        ('enabled = true\n[[tenants.tenant]]\nname = "a"\n', "tenants.require_key", "keys_file"),
        (
            'enabled = true\nrequire_key = false\n[[tenants.tenant]]\nname = "a"\n',
            "tenants.require_key",
            "header or default_tenant",
        ),
        (
            '[[tenants.tenant]]\nname = "a"\nkey_sha256 = ["sk-live-123"]\n',
            "key_sha256[0]",
            "not the key",
        ),
        ('[[tenants.tenant]]\nname = "a"\nweight = 0\n', "tenants.tenant[0].weight", "> 0"),
        ('[[tenants.tenant]]\nname = "a"\nrequests_per_s = -1\n', "requests_per_s", "> 0"),
        (
            '[[tenants.tenant]]\nname = "a"\n[[tenants.tenant]]\nname = "a"\n',
            "tenant[1].name",
            "duplicate",
        ),
        ('default_tenant = "x"\n', "tenants.default_tenant", "must name a tenant"),
        ('header = "Authorization"\n', "tenants.header", "must not be Authorization"),
        ('header = "x tenant"\n', "tenants.header", "HTTP header name"),
        ("over_share_headroom = 1.0\n", "tenants.over_share_headroom", "[0, 1)"),
    ],
)
def test_tenant_table_mistakes(tmp_path: Path, tenants: str, key: str, words: str) -> None:
    msg = _load(tmp_path, tenants)
    assert key in msg and words in msg, msg


def test_a_raw_key_in_key_sha256_is_not_echoed() -> None:
    data = {"tenants": {"tenant": [{"name": "a", "key_sha256": ["sk-live-secret"]}]}}
    with pytest.raises(ConfigError) as err:
        settings_from_dict(data)
    assert "key_sha256[0]" in str(err.value) and "sk-live-secret" not in str(err.value)


def test_the_same_key_for_two_tenants_is_refused() -> None:
    data = {
        "tenants": {
            "tenant": [{"name": "a", "key_sha256": [H1]}, {"name": "b", "key_sha256": [H1]}]
        }
    }
    with pytest.raises(ConfigError) as err:
        settings_from_dict(data)
    assert "duplicate API key" in str(err.value)


def test_defaults_are_off_and_valid() -> None:
    t = settings_from_dict({}).tenants
    assert not t.enabled and t.tenant == () and t.fair_share and t.over_share_headroom == 0.5
