"""Validation of the ``[replicas]`` section (docs/replicas.md), called from config/checks.py."""

from __future__ import annotations

from config.checker import Checker
from config.replica_settings import ReplicasSettings


def _endpoint_problem(endpoint: str) -> str | None:
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return "must be a ZMQ endpoint (tcp://host:port, ipc://path or inproc://name)"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            return "tcp endpoints need host:port with a port in 1-65535"
    return None


def check_replicas(c: Checker, r: ReplicasSettings) -> None:
    key = "replicas."
    c.positive(key + "publish_interval_s", r.publish_interval_s)
    if r.ttl_s is not None:
        c.require(
            r.ttl_s > r.publish_interval_s,
            key + "ttl_s",
            r.ttl_s,
            f"must be > publish_interval_s ({r.publish_interval_s}): a live peer would expire",
        )
    if r.replica_id is not None:
        c.require(
            bool(r.replica_id) and "\x00" not in r.replica_id and len(r.replica_id) <= 200,
            key + "replica_id",
            r.replica_id,
            "must be 1-200 characters without NUL",
        )
    for name, endpoint in (("bind", r.bind), *((f"peers[{i}]", p) for i, p in enumerate(r.peers))):
        problem = _endpoint_problem(endpoint)
        c.require(problem is None, key + name, endpoint, problem or "")
    c.require(r.bind not in r.peers, key + "peers", list(r.peers), "must not contain own bind")
    c.require(len(set(r.peers)) == len(r.peers), key + "peers", list(r.peers), "duplicate endpoint")
