"""`kvgate envoy-config`: the Envoy config for a kvgate config's fleet. The example file is
what it writes for the colocated example; a P/D fleet lists the decode sidecars only; a fleet
with llama.cpp engines gets one request per connection; bad input exits 2 with a message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main

yaml = pytest.importorskip("yaml")
EXAMPLES = Path(__file__).resolve().parents[3] / "config" / "examples"


def _write(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "envoy.json"
    assert main(["envoy-config", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _engines(cfg: dict) -> list[tuple[str, int]]:
    [cluster] = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "engines"]
    [group] = cluster["load_assignment"]["endpoints"]
    sockets = [e["endpoint"]["address"]["socket_address"] for e in group["lb_endpoints"]]
    return [(s["address"], s["port_value"]) for s in sockets]


def _options(cfg: dict) -> dict:
    [cluster] = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "engines"]
    http = cluster["typed_extension_protocol_options"]
    return next(iter(http.values()))["common_http_protocol_options"]


def test_the_example_is_what_it_writes_for_the_colocated_example(tmp_path: Path) -> None:
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
    cfg = _write(tmp_path, "--config", str(EXAMPLES / "colocated.toml"), "--admin-port", "9901")
    assert cfg == yaml.safe_load((EXAMPLES / "envoy-epp.yaml").read_text())


def test_a_pd_fleet_lists_the_decode_sidecars_and_llamacpp_one_request_per_connection(
    tmp_path: Path, capsys
) -> None:
    pd = _write(tmp_path, "--config", str(EXAMPLES / "pd-vllm-epp.toml"), "--epp", "10.0.0.5:9002")
    assert _engines(pd) == [("127.0.0.1", 8202)]  # the sidecar; the prefill engine is not listed
    assert "max_requests_per_connection" not in _options(pd)
    assert 'declare engine = "llamacpp"' in capsys.readouterr().err  # its kinds are "auto"
    [epp] = [c for c in pd["static_resources"]["clusters"] if c["name"] == "kvgate_epp"]
    epp_socket = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert epp_socket["address"]["socket_address"] == {"address": "10.0.0.5", "port_value": 9002}
    config = tmp_path / "llama.toml"
    config.write_text(
        '[[pools]]\nname = "w"\nrole = "both"\n'
        '[[pools.instances]]\nid = "l0"\nurl = "http://127.0.0.1:8401"\nengine = "llamacpp"\n'
        '[[pools.instances]]\nid = "v0"\nurl = "http://127.0.0.1:8402"\n'
    )
    llama = _write(
        tmp_path, "--config", str(config), "--listen", "127.0.0.1:8081", "--engine-idle-s", "2.5"
    )
    assert _engines(llama) == [("127.0.0.1", 8401), ("127.0.0.1", 8402)]
    assert _options(llama) == {"idle_timeout": "2.5s", "max_requests_per_connection": 1}
    assert "declare" not in capsys.readouterr().err


def test_bad_input_exits_2_with_a_message(tmp_path: Path, capsys) -> None:
    assert main(["envoy-config", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml" in capsys.readouterr().err
    bad = tmp_path / "pd.toml"
    bad.write_text(
        '[[pools]]\nname = "p"\nrole = "prefill"\n'
        '[[pools.instances]]\nid = "p0"\nurl = "http://127.0.0.1:8501"\n'
        '[[pools]]\nname = "d"\nrole = "decode"\n'
        '[[pools.instances]]\nid = "d0"\nurl = "http://127.0.0.1:8502"\n'
    )
    assert main(["envoy-config", "--config", str(bad)]) == 2
    assert "sidecar_url" in capsys.readouterr().err
    assert main(["envoy-config", "--config", str(bad), "--engine-idle-s", "0"]) == 2
    assert "--engine-idle-s > 0" in capsys.readouterr().err
    nameless = tmp_path / "nameless.toml"  # Envoy's STATIC cluster takes addresses: resolved
    nameless.write_text(
        '[[pools]]\nname = "w"\nrole = "both"\n'
        '[[pools.instances]]\nid = "w0"\nurl = "http://no-such-host.invalid:8401"\n'
    )
    assert main(["envoy-config", "--config", str(nameless)]) == 2
    assert "engine address" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["envoy-config", "--config", str(bad), "--listen", "8081"])
    assert exit_.value.code == 2
