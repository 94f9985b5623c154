"""deploy/grafana/kvroute-dashboard.json: a well-formed Grafana dashboard over metrics that exist.

The metric names come from a router built by `create_app` (its Prometheus registry, as
`/metrics` serves it), not from a list kept here, so a renamed or removed metric fails this
test instead of leaving an empty panel. Every PromQL expression is read down to its metric
names, label matchers, grouping labels and functions, and each must be one the router
exports or PromQL knows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvroute.router.app import create_app
from kvroute.router.config_load import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute-dashboard.json"

PANEL_TYPES = {"row", "timeseries", "piechart", "stat", "gauge", "bargauge", "table", "text"}
FUNCTIONS = {
    "abs", "absent", "avg", "avg_over_time", "bottomk", "ceil", "changes", "clamp_max",
    "clamp_min", "count", "count_over_time", "delta", "deriv", "floor", "histogram_quantile",
    "idelta", "increase", "irate", "label_replace", "last_over_time", "max", "max_over_time",
    "min", "min_over_time", "quantile", "quantile_over_time", "rate", "resets", "round",
    "scalar", "sort", "sort_desc", "sqrt", "stddev", "sum", "sum_over_time", "time", "topk",
    "vector",
}  # fmt: skip
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
GROUPING = ("by", "without", "on", "ignoring", "group_left", "group_right")
# Labels Prometheus adds to every scraped series (target labels of the ServiceMonitor).
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "endpoint", "container"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range", "__range_s", "__all"}


def exported_metrics() -> dict[str, set[str]]:
    """Series name -> its label names, for every series a router's /metrics can carry."""
    app = create_app(config_from_dict({"workers": [{"name": "w0", "url": "http://127.0.0.1:9"}]}))
    series: dict[str, set[str]] = {}
    for family in app.state.kvroute.metrics.registry.collect():
        labels = set(getattr(family, "_labelnames", ())) | TARGET_LABELS
        suffixes = {
            "counter": ("_total",),
            "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("", "_sum", "_count"),
        }[family.type]
        for suffix in suffixes:
            series[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return series


def promql_problems(expr: str, series: dict[str, set[str]]) -> list[str]:
    """What in one expression is not an exported series, a label of it or a PromQL function."""
    problems: list[str] = []
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string values say nothing of names
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors: [5m], [$__rate_interval]
    used: list[str] = []
    grouping: list[str] = []

    def take_grouping(m: re.Match[str]) -> str:
        grouping.extend(s.strip() for s in m.group(2).split(",") if s.strip())
        return " "

    text = re.sub(r"\b(" + "|".join(GROUPING) + r")\s*\(([^)]*)\)", take_grouping, text)
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{([^}]*)\})?\s*(\()?", text):
        name, matchers, call = m.group(1), m.group(3), m.group(4)
        if call and not matchers:
            if name not in FUNCTIONS:
                problems.append(f"unknown function {name}()")
            continue
        if name.lower() in KEYWORDS:
            continue
        if name not in series:
            problems.append(f"{name} is not a metric the router exports")
            continue
        used.append(name)
        for matcher in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""):
            if matcher not in series[name]:
                problems.append(f"{name} has no label {matcher}")
    if not used:
        problems.append("no metric in the expression")
    labels = set().union(*(series[n] for n in used)) if used else set()
    problems += [f"no metric here has the label {g}" for g in grouping if g not in labels]
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def series() -> dict[str, set[str]]:
    return exported_metrics()


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows keep their panels inside
    return out


def _variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def test_dashboard_basics(dashboard: dict[str, Any]) -> None:
    assert isinstance(dashboard["title"], str) and dashboard["title"]
    assert isinstance(dashboard["uid"], str) and 0 < len(dashboard["uid"]) <= 40
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["time"]["from"] and dashboard["time"]["to"]
    source = _variables(dashboard)["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"


def test_panels_have_ids_places_and_targets(dashboard: dict[str, Any]) -> None:
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids)
    boxes = []
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["type"]
        assert p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        boxes.append((p["title"], g))
        if p["type"] in ("row", "text"):
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1 :]:
            apart = (
                ga["x"] + ga["w"] <= gb["x"]
                or gb["x"] + gb["w"] <= ga["x"]
                or ga["y"] + ga["h"] <= gb["y"]
                or gb["y"] + gb["h"] <= ga["y"]
            )
            assert apart, f"panels {a!r} and {b!r} overlap"


def test_every_expression_uses_exported_metrics(
    dashboard: dict[str, Any], series: dict[str, set[str]]
) -> None:
    problems = []
    exprs = [(p["title"], t["expr"]) for p in _panels(dashboard) for t in p.get("targets", [])]
    assert len(exprs) >= 20
    for title, expr in exprs:
        problems += [f"{title}: {x}" for x in promql_problems(expr, series)]
    for var in _variables(dashboard).values():
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            assert m.group(2) in series.get(m.group(1), set()), var["definition"]
    assert not problems, "\n".join(problems)


def test_variables_used_are_defined(dashboard: dict[str, Any]) -> None:
    defined = set(_variables(dashboard)) | GRAFANA_VARIABLES
    text = json.dumps(dashboard["panels"])
    used = set(re.findall(r"\$\{?(\w+)", text))
    assert used <= defined, used - defined


def test_it_shows_what_an_operator_needs(dashboard: dict[str, Any]) -> None:
    text = json.dumps(dashboard["panels"])
    for topic, names in {
        "routing reasons": ["kvroute_routing_decisions_total"],
        "predicted vs engine-reported cached tokens": [
            "kvroute_predicted_cached_tokens_total",
            "kvroute_reported_cached_tokens_total",
        ],
        "per-worker load": ["kvroute_worker_running", "kvroute_worker_queued_prefill_tokens"],
        "per-worker index size": ["kvroute_worker_index_entries"],
        "event lag": ["kvroute_worker_events_age_seconds"],
        "each worker's CPU-tier rate": [
            "kvroute_worker_cpu_tier_tokens_per_second",
            "kvroute_worker_cpu_tier_rate_learned",
        ],
    }.items():
        for name in names:
            assert re.search(rf"\b{name}\b", text), f"{topic}: {name} not shown"


def test_the_checker_catches_what_it_should(series: dict[str, set[str]]) -> None:
    ok = 'sum by (worker) (rate(kvroute_event_batches_total{worker=~"$worker"}[5m]))'
    assert promql_problems(ok, series) == []
    assert (
        promql_problems(
            "histogram_quantile(0.99, sum by (le) (rate(kvroute_event_apply_seconds_bucket[5m])))",
            series,
        )
        == []
    )
    assert promql_problems("rate(kvroute_event_batches[5m])", series)  # a counter's _total
    assert promql_problems("rate(kvroute_no_such_metric_total[5m])", series)
    assert promql_problems("rat(kvroute_event_batches_total[5m])", series)
    assert promql_problems('kvroute_worker_running{model="m"}', series)
    assert promql_problems("sum by (model) (kvroute_worker_running)", series)
    assert promql_problems("1 + 1", series)
    relabelled = 'label_replace(kvroute_worker_running, "w", "$1", "worker", "(.*)")'
    assert promql_problems(relabelled, series) == []
