"""Tenants on the OpenAI endpoints: API keys (hashed, reloadable), a trusted tenant header,
per-tenant token buckets, fair sharing on top of SLO admission, metrics and GET /admin/tenants."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from starlette.testclient import TestClient

from config.loader import load_settings, settings_from_dict
from config.tenant_keys import hash_key
from gateway.app import build_app
from gateway.stack import LiveStack, StackSpec
from gateway.tenants import TenantGate
from routing.types import Decision, Rejection, RequestInfo

ADMIN = "adm1n-token"
KEY_A, KEY_B, KEY_NEW = "sk-tenant-a", "sk-tenant-b", "sk-tenant-b-2"
PROMPT = {"prompt": "hello " * 40, "max_tokens": 4}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(keys_file: Path, **tenants: Any) -> dict[str, Any]:
    return {
        "server": {"admin_token": ADMIN, "health_interval_s": 30.0, "refit_interval_s": 0},
        "admission": {"mode": "early"},
        "tenants": {
            "enabled": True,
            "keys_file": str(keys_file),
            "header": "X-Tenant",
            "tenant": [
                {
                    "name": "a",
                    "weight": 1.0,
                    "requests_per_s": 1.0,
                    "burst_s": 2.0,
                    "key_sha256": [hash_key(KEY_A)],
                },
                {"name": "b", "weight": 3.0, "tokens_per_s": 100.0},
            ],
            **tenants,
        },
        # Never listened on: a request that gets past the tenant checks fails to connect.
        "pools": [
            {"name": "w", "role": "both", "instances": [{"id": "w0", "url": "http://127.0.0.1:9"}]}
        ],
    }


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    f = tmp_path / "keys.txt"
    f.write_text(f"# tenant  sha256 of the key\nb {hash_key(KEY_B)}\n")
    return f


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def client(keys_file: Path, clock: FakeClock) -> Iterator[TestClient]:
    app = build_app(settings_from_dict(_config(keys_file)), clock=clock)
    with TestClient(app) as c:
        yield c


def _post(c: TestClient, key: str | None = None, headers: dict[str, str] | None = None, **body):
    h = dict(headers or {})
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    return c.post("/v1/completions", json={**PROMPT, **body}, headers=h)


def _admin(c: TestClient, path: str):
    return c.get(path, headers={"Authorization": f"Bearer {ADMIN}"})


def test_missing_or_wrong_key_is_401_invalid_api_key(client: TestClient) -> None:
    for key in (None, "sk-wrong", ""):
        r = _post(client, key)
        assert r.status_code == 401, (key, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"}
        assert r.headers["www-authenticate"].startswith("Bearer")
    r = client.post("/v1/chat/completions", json={}, headers={"Authorization": "Basic xyz"})
    assert r.status_code == 401
    # Admin, health and metrics are not behind client keys.
    assert _admin(client, "/admin/state").status_code == 200
    assert client.get("/health").status_code in (200, 503)
    assert b"kvgate_requests_total" in client.get("/metrics").content


def test_a_valid_key_passes_to_the_engine(client: TestClient) -> None:
    for key in (KEY_A, KEY_B):  # a's key from the config, b's from the keys file
        r = _post(client, key)
        # Past auth and limits: the engine leg (nothing listens) is what fails.
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] != "invalid_api_key"


def test_the_request_path_never_reads_the_keys_file(client: TestClient, keys_file: Path) -> None:
    # Keys are read at start-up and on reload (off the event loop); a settings change by the
    # admin API makes the tenant gate re-sync, from the keys the gateway holds, not the file.
    keys_file.write_text(f"b {hash_key(KEY_NEW)}\n")  # b's old key is gone from the file
    r = client.put(
        "/admin/slo", json={"ttft_s": 25.0}, headers={"Authorization": f"Bearer {ADMIN}"}
    )
    assert r.status_code == 200, r.text
    assert _post(client, KEY_B).status_code in (502, 503)  # still the keys read at start-up
    assert _post(client, KEY_NEW).status_code == 401  # the file's new key needs a reload


def test_requests_per_second_bucket_429_with_retry_after(
    client: TestClient, clock: FakeClock
) -> None:
    assert _post(client, KEY_A).status_code != 429
    assert _post(client, KEY_A).status_code != 429  # burst 2 at 1 req/s
    r = _post(client, KEY_A)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
    assert "'a'" in err["message"]
    assert r.headers["retry-after"] == "1"
    assert r.headers["x-kvgate-reject-reason"] == "tenant_rate_limit"
    assert _post(client, KEY_B).status_code != 429  # b has its own buckets
    clock.now += 1.0  # one request refilled
    assert _post(client, KEY_A).status_code != 429
    assert _post(client, KEY_A).status_code == 429


def test_tokens_per_second_bucket_counts_prompt_tokens(
    client: TestClient, clock: FakeClock
) -> None:
    # b: 100 prompt tokens/s, burst 1 s. A 75-token prompt (300 chars) fits once, not twice.
    prompt = "word " * 60
    assert _post(client, KEY_B, prompt=prompt).status_code != 429
    r = _post(client, KEY_B, prompt=prompt)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
    assert r.headers["retry-after"] == "1"  # 50 tokens short at 100/s: 0.5 s, rounded up
    clock.now += 0.5
    assert _post(client, KEY_B, prompt=prompt).status_code != 429
    # A prompt larger than the whole bucket waits for a full bucket, then goes through.
    big = "word " * 400
    r = _post(client, KEY_B, prompt=big)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    clock.now += 1.0
    assert _post(client, KEY_B, prompt=big).status_code != 429


def test_trusted_header_only_when_configured(keys_file: Path) -> None:
    app = build_app(settings_from_dict(_config(keys_file)))
    with TestClient(app) as c:
        assert _post(c, headers={"X-Tenant": "b"}).status_code in (502, 503)
        r = _post(c, headers={"X-Tenant": "mallory"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "unknown_tenant"
        # A key, when given, decides: a wrong one is 401 whatever the header says.
        assert _post(c, "sk-wrong", headers={"X-Tenant": "b"}).status_code == 401
    data = _config(keys_file)
    del data["tenants"]["header"]
    with TestClient(build_app(settings_from_dict(data))) as c:
        assert _post(c, headers={"X-Tenant": "b"}).status_code == 401


def test_default_tenant_when_keys_are_not_required(keys_file: Path) -> None:
    data = _config(keys_file, require_key=False, default_tenant="b")
    with TestClient(build_app(settings_from_dict(data))) as c:
        assert _post(c).status_code in (502, 503)
        view = _admin(c, "/admin/tenants").json()
        b = next(t for t in view["tenants"] if t["name"] == "b")
        assert sum(b["outcomes"].values()) == 1


def test_off_by_default_no_key_needed() -> None:
    data = _config(Path("/nonexistent"))
    del data["tenants"]
    with TestClient(build_app(settings_from_dict(data))) as c:
        r = _post(c)
        assert r.status_code in (502, 503) and r.json()["error"]["code"] != "invalid_api_key"
        assert _admin(c, "/admin/tenants").json() == {
            "enabled": False,
            "require_key": True,
            "header": None,
            "fair_share": True,
            "over_share_headroom": 0.5,
            "tenants": [],
        }


def test_keys_file_reload_adds_keys_and_a_bad_file_changes_nothing(
    tmp_path: Path, keys_file: Path
) -> None:
    cfg = tmp_path / "kvgate.toml"
    cfg.write_text(f"""
[server]
admin_token = "{ADMIN}"
health_interval_s = 30.0
refit_interval_s = 0

[tenants]
enabled = true
keys_file = "{keys_file}"

[[tenants.tenant]]
name = "b"

[[pools]]
name = "w"
role = "both"
[[pools.instances]]
id = "w0"
url = "http://127.0.0.1:9"
""")
    app = build_app(load_settings(cfg))
    app.gateway.config_path = str(cfg)
    with TestClient(app) as c:
        assert _post(c, KEY_NEW).status_code == 401
        keys_file.write_text(f"b {hash_key(KEY_B)}\nb {hash_key(KEY_NEW)}\n")
        r = c.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert _post(c, KEY_NEW).status_code in (502, 503)
        keys_file.write_text(f"b {hash_key(KEY_B)}\nb not-a-hash\n")
        r = c.post("/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert str(keys_file) in msg and "line 2" in msg
        assert _post(c, KEY_NEW).status_code in (502, 503)  # the running keys stay


def _decision(rid: str, ttft_s: float, slo_ttft_s: float = 1.0) -> Decision:
    return Decision(
        request_id=rid,
        prefill="w0",
        decode="w0",
        predicted_ttft_s=ttft_s,
        predicted_tbt_s=0.01,
        predicted_queue_s=0.0,
        predicted_prefill_s=ttft_s,
        predicted_transfer_s=0.0,
        predicted_load_s=0.0,
        predicted_output_tokens=64,
        cached_tokens=0,
        prompt_tokens=1000,
        policy="kvcache_centric",
        reason="test",
        priority="high",  # no priority headroom: only the tenant's
        slo_ttft_s=slo_ttft_s,
        slo_tbt_s=0.1,
    )


def _info(rid: str) -> RequestInfo:
    return RequestInfo(rid, 1000, (), 64, 0.0)


def test_fair_share_sheds_the_over_share_tenant_first(keys_file: Path, clock: FakeClock) -> None:
    settings = settings_from_dict(_config(keys_file))
    settings = replace(
        settings,
        tenants=replace(
            settings.tenants,
            tenant=tuple(
                replace(t, requests_per_s=None, tokens_per_s=None) for t in settings.tenants.tenant
            ),
        ),
    )
    app = build_app(settings, clock=clock)
    gate: TenantGate = app._completions.tenants
    now = clock.now
    # a has asked for a lot recently; b (weight 3) arrives.
    for i in range(5):
        assert gate.admit("a", f"a{i}", _info(f"a{i}"), now) is None
        assert isinstance(gate.screen(_decision(f"a{i}", 0.1), _info(f"a{i}"), now), Decision)
    assert gate.admit("b", "b0", _info("b0"), now) is None
    # At 80 % of the SLO: a (over its 1/4 share) keeps 50 % headroom and is turned away;
    # b (within its share) is admitted up to the SLO itself.
    out = (
        gate.screen(_decision("a5", 0.8), _info("a5"), now)
        if gate.admit("a", "a5", _info("a5"), now) is None
        else None
    )
    assert isinstance(out, Rejection)
    assert out.reason.value == "ttft_slo" and "fair share" in out.message
    assert out.limit_s == pytest.approx(0.5)
    # Counted in the Conductor's rejection stats (/admin/state) like any rejection.
    assert app.gateway.conductor.stats.rejections == {"ttft_slo": 1}
    assert isinstance(gate.screen(_decision("b0", 0.8), _info("b0"), now), Decision)
    # Below the tightened limit a is still served: sharing never idles the fleet.
    assert gate.admit("a", "a6", _info("a6"), now) is None
    assert isinstance(gate.screen(_decision("a6", 0.4), _info("a6"), now), Decision)
    # ... unless its wait, stretched by the margin admission learned, takes it over the limit.
    app.gateway.conductor.admission.wait_margin_for(None).factor = 2.0
    waits = replace(_decision("a8", 0.4), predicted_queue_s=0.2, predicted_prefill_s=0.2)
    assert gate.admit("a", "a8", _info("a8"), now) is None
    assert isinstance(gate.screen(waits, _info("a8"), now), Rejection)  # 0.4 + 0.2 > 0.5
    app.gateway.conductor.admission.wait_margin_for(None).factor = 1.0
    # The TBT as admission checked it counts, not the decode-only one: on a colocated engine
    # a's prefill would stall the decodes there to 80 % of the TBT SLO (over a's 50 %).
    stalls = replace(_decision("a9", 0.1), checked_tbt_s=0.08)
    assert gate.admit("a", "a9", _info("a9"), now) is None
    out = gate.screen(stalls, _info("a9"), now)
    assert isinstance(out, Rejection) and out.reason.value == "tbt_slo"
    assert gate.admit("b", "b1", _info("b1"), now) is None  # b, within its share: admitted
    assert isinstance(gate.screen(replace(stalls, request_id="b1"), _info("b1"), now), Decision)
    # With fair_share off, a is only held to the SLO.
    gate.apply(replace(gate.cfg, fair_share=False))
    assert gate.admit("a", "a7", _info("a7"), now) is None
    assert isinstance(gate.screen(_decision("a7", 0.8), _info("a7"), now), Decision)
    for rid in ("a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7", "a8", "a9", "b0", "b1"):
        gate.leave(rid)
    assert all(st.in_flight == 0 for st in gate.states.values())
    metrics = app.gateway.metrics.render().decode()
    assert 'kvgate_tenant_over_share_rejections_total{tenant="a"} 3.0' in metrics


def test_end_to_end_on_emulators_metrics_and_admin() -> None:
    async def run() -> tuple[list[int], dict, str, int]:
        base = settings_from_dict(
            {
                "server": {"admin_token": ADMIN},
                "tenants": {
                    "enabled": True,
                    "tenant": [
                        {"name": "a", "key_sha256": [hash_key(KEY_A)], "requests_per_s": 2.0},
                    ],
                },
            }
        )
        stack = LiveStack(StackSpec(prefill=1, decode=1, time_scale=0.02, base=base))
        await stack.start()
        try:
            statuses = []
            async with aiohttp.ClientSession() as s:
                for _ in range(4):
                    async with s.post(
                        stack.url + "/v1/completions",
                        json={**PROMPT, "stream": True},
                        headers={"Authorization": f"Bearer {KEY_A}"},
                    ) as r:
                        await r.read()
                        statuses.append(r.status)
                admin = {"Authorization": f"Bearer {ADMIN}"}
                async with s.get(stack.url + "/admin/tenants", headers=admin) as r:
                    view = await r.json()
                async with s.get(stack.url + "/metrics") as r:
                    metrics = await r.text()
            return statuses, view, metrics, len(stack.gateway.conductor.requests)
        finally:
            await stack.stop()

    statuses, view, metrics, in_flight = asyncio.run(run())
    assert statuses[:2] == [200, 200] and 429 in statuses[2:]
    a = view["tenants"][0]
    assert a["name"] == "a" and a["keys"] == 1 and a["in_flight"] == 0
    assert a["outcomes"]["completed"] == 2 and a["outcomes"]["rate_limited"] >= 1
    assert 'kvgate_tenant_requests_total{outcome="completed",tenant="a"} 2.0' in metrics
    assert 'kvgate_tenant_in_flight{tenant="a"} 0.0' in metrics
    assert in_flight == 0
