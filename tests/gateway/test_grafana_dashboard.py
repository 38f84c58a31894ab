"""config/examples/grafana-kvgate.json: every PromQL expression parses and every metric it reads
is in the /metrics of a gateway running on emulators (histogram and counter suffixes mapped to
their families), so a renamed metric breaks this test instead of a dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.stack import StackSpec
from tests.gateway.live import live_stack
from tests.gateway.promql import PromQLError, metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "examples" / "grafana-kvgate.json"
_LABEL_VALUES = re.compile(r"^label_values\((?:(?P<expr>.+),\s*)?(?P<label>\w+)\)$")


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out.extend(_panels(p.get("panels", [])))  # collapsed rows keep their panels inside
    return out


def _expressions(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m is not None, f"variable {var['name']}: not label_values(...): {query!r}"
        if m.group("expr"):
            exprs.append(m.group("expr"))
    return exprs


def exposed_names(text: str) -> set[str]:
    """The series names a Prometheus server scraping ``text`` would store."""
    names: set[str] = set()
    for fam in text_string_to_metric_families(text):
        names.update(s.name for s in fam.samples)
        if fam.type == "counter":
            names.update({fam.name + "_total", fam.name + "_created"})
        elif fam.type == "histogram":
            names.update(fam.name + s for s in ("_bucket", "_sum", "_count", "_created"))
        else:
            names.add(fam.name)
    return names


def test_promql_checker_rejects_what_it_should() -> None:
    assert metric_names(
        'histogram_quantile(0.9, sum by (le) (rate(a_bucket{job=~"$job"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert metric_names("sum(rate(x_total[5m])) / ignoring(k) group_left b > bool 1") == {
        "x_total",
        "b",
    }
    assert metric_names("max_over_time(g[1h:30s]) offset 5m - -2") == {"g"}
    for bad in (
        "rate(x[5m]",
        "nosuchfn(x)",
        "sum by le (x)",
        'x{job~"a"}',
        "rate(x[five])",
        "x +",
        "",
    ):
        with pytest.raises(PromQLError):
            metric_names(bad)


def test_exposed_names_map_suffixes_to_families() -> None:
    text = (
        "# HELP h_seconds h\n# TYPE h_seconds histogram\n"
        "# HELP c_total c\n# TYPE c_total counter\n"
        "# HELP g g\n# TYPE g gauge\n"
    )
    names = exposed_names(text)
    assert {"h_seconds_bucket", "h_seconds_sum", "h_seconds_count", "c_total", "g"} <= names
    assert "h_seconds" not in names and "c" not in names


@pytest.fixture(scope="module")
def metrics_text() -> str:
    """/metrics of a gateway on one prefill and one decode emulator, after two requests."""
    with live_stack(StackSpec(prefill=1, decode=1, time_scale=0.02, model="m")) as s:

        async def scrape() -> str:
            async with aiohttp.ClientSession() as session:
                for stream in (False, True):
                    body = {"model": "m", "prompt": "hello " * 40, "max_tokens": 4}
                    body["stream"] = stream
                    async with session.post(s.url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                s.gateway._publish_gauges()  # as the scrape loop does every interval
                async with session.get(s.url + "/metrics") as r:
                    assert r.status == 200
                    return await r.text()

        return s.run(scrape())


def test_every_dashboard_expression_parses_and_reads_existing_metrics(metrics_text: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = _expressions(dash)
    assert len(exprs) >= 20  # the dashboard was read, not an empty list
    exposed = exposed_names(metrics_text)
    missing: dict[str, set[str]] = {}
    for expr in exprs:
        names = metric_names(expr)  # raises on a syntax error, naming the expression
        assert names, f"reads no metric: {expr!r}"
        unknown = names - exposed
        if unknown:
            missing[expr] = unknown
    assert not missing, f"metrics not in the gateway's /metrics: {missing}"
    assert {"kvgate_pool_instances_needed", "kvgate_pool_instances"} <= exposed


def test_capacity_gauge_is_sane_on_a_live_gateway(metrics_text: str) -> None:
    values = {
        (s.name, s.labels.get("pool")): s.value
        for fam in text_string_to_metric_families(metrics_text)
        for s in fam.samples
        if s.name.startswith("kvgate_pool_")
    }
    assert values[("kvgate_pool_instances", "prefill")] == 1
    assert values[("kvgate_pool_instances", "decode")] == 1
    for pool in ("prefill", "decode"):  # two tiny requests: a fraction of one instance
        assert values[("kvgate_pool_instances_needed", pool)] == 1
        assert 0 < values[("kvgate_pool_load_instances", pool)] < 1
