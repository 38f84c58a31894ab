"""Configuration reload without a restart (POST /admin/reload; SIGHUP runs the same code, see
test_shutdown.py): validated exactly like start-up, a bad file changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from config.loader import ConfigError, load_settings
from gateway.app import build_app
from gateway.reload import reload_config

TOKEN = "r3load"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _toml(
    instances: tuple[str, ...] = ("w0", "w1"),
    ttft_s: float = 5.0,
    policy: str = "least_load",
    extra_server: str = "",
    block_size: int = 16,
) -> str:
    # wN on port 9 + N, never listened on: instances start unhealthy, which a reload ignores.
    pools = "".join(
        f'\n[[pools.instances]]\nid = "{iid}"\nurl = "http://127.0.0.1:{9 + int(iid[1:])}"\n'
        for iid in instances
    )
    return f"""
[server]
admin_token = "{TOKEN}"
health_interval_s = 30.0
refit_interval_s = 0
{extra_server}

[slo]
ttft_s = {ttft_s}

[routing]
policy = "{policy}"
block_size = {block_size}

[[pools]]
name = "w"
role = "both"
{pools}"""


@pytest.fixture
def setup(tmp_path: Path):
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_toml())
    app = build_app(load_settings(cfg))
    app.gateway.config_path = str(cfg)
    with TestClient(app) as client:
        yield cfg, client


def test_a_valid_file_is_applied_live(setup) -> None:
    cfg, client = setup
    gw = client.app.gateway
    cfg.write_text(
        _toml(
            instances=("w1", "w2"),
            ttft_s=2.5,
            extra_server="health_timeout_s = 7.0\nhealth_recheck_s = 0.5\nsilence_min_s = 12.0",
            block_size=32,
        )
    )
    r = client.post("/admin/reload", headers=AUTH)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["ok"] and out["added"] == ["w2"] and out["removed"] == ["w0"]
    assert out["changed"] == []
    assert out["restart_required"] == ["routing.block_size"]
    assert set(gw.conductor.instances) == {"w1", "w2"}
    assert gw.conductor.settings.slo.ttft_s == 2.5 and gw.settings.slo.ttft_s == 2.5
    assert gw.settings.server.silence_min_s == 12.0
    assert gw.legs.checker is not None and gw.legs.checker.timeout_s == 7.0
    assert gw.legs.checker.recheck_s == 0.5
    assert gw.settings.routing.block_size == 16  # the running key space stays
    assert [i.id for i in gw.settings.instances()] == ["w1", "w2"]
    # A changed instance (same id, another URL) is replaced.
    cfg.write_text(_toml(instances=("w1", "w2"), ttft_s=2.5).replace(":10", ":20"))
    out = client.post("/admin/reload", headers=AUTH).json()
    assert out["changed"] == ["w1"] and gw.targets["w1"].url == "http://127.0.0.1:20"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (_toml() + "\n[slo\n", "line"),  # TOML syntax: the loader names the line
        (_toml(ttft_s=-1.0), "slo.ttft_s"),
        (_toml(extra_server="silence_min_s = 60.0\nsilence_max_s = 30.0"), "silence_"),
        (_toml(policy="no_such_policy"), "no_such_policy"),
    ],
)
def test_a_bad_file_changes_nothing_and_answers_400(setup, text: str, says: str) -> None:
    cfg, client = setup
    gw = client.app.gateway
    before = gw.settings
    cfg.write_text(text)
    r = client.post("/admin/reload", headers=AUTH)
    assert r.status_code == 400
    err = r.json()["error"]
    assert says in err["message"] and err["type"] == "invalid_request_error"
    assert gw.settings is before and set(gw.conductor.instances) == {"w0", "w1"}


def test_the_same_checks_refuse_the_file_at_start_up(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(_toml(extra_server="health_timeout_s = 0\ndrain_timeout_s = -1"))
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert "server.health_timeout_s" in str(err.value)
    assert "server.drain_timeout_s" in str(err.value)


def test_reload_needs_a_config_file_and_the_token(setup) -> None:
    _, client = setup
    assert client.post("/admin/reload").status_code == 401
    client.app.gateway.config_path = None
    r = client.post("/admin/reload", headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["message"]


def test_reload_config_reports_without_raising(tmp_path: Path) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(_toml())
    app = build_app(load_settings(cfg))
    result = asyncio.run(reload_config(app.gateway, str(tmp_path / "missing.toml")))
    assert not result.ok and "cannot read config file" in (result.error or "")
