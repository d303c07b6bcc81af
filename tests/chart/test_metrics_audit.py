"""Every metric the Grafana dashboard and the alerts query exists in what rota's
components really export, with the labels the queries use; and every dashboard query is
valid PromQL (promtool parses it).

The exported metrics are read from the components' own registries (the driver's, the lease
controller's, and a gateway application's), after importing every module that registers
metrics. The dashboard and the rules are written against the target names of the rename
in docs/metrics.md; until that rename lands, the names it introduces are listed in
:data:`EXPECTED_MISSING`. The list must shrink as metrics are renamed: an entry that does
exist is an error too, so the list never hides a name that is already there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from e2e.chart import CHART, run_tool

DASHBOARD = CHART / "files" / "dashboards" / "rota.json"
RULES = CHART / "files" / "prometheus" / "rules.yaml"

SCRAPE_LABELS = frozenset({"node", "namespace", "pod", "instance", "job", "container",
                           "service", "endpoint"})
"""Labels the scrape adds (the chart's ServiceMonitor/PodMonitor add ``node``)."""

EXPECTED_MISSING = frozenset({
    # The rename of docs/metrics.md, not yet done in the components. Metric names, and
    # "metric{label}" for a label a query uses that the metric does not carry yet.
})


def _registries() -> list[CollectorRegistry]:
    # Importing the applications imports every module that defines metrics.
    import controller.app
    import controller.gateway.app  # noqa: F401
    import driver.app  # noqa: F401
    from controller import metrics as controller_metrics
    from controller.gateway.metrics import GatewayMetrics
    from driver import metrics as driver_metrics

    return [driver_metrics.REGISTRY, controller_metrics.REGISTRY,
            GatewayMetrics(gate_counts=dict).registry]


def _collectors(registry: CollectorRegistry) -> Iterator[Collector]:
    # The registry has no public list of its collectors; labels of a metric with no
    # sample yet are known only to its collector.
    yield from list(registry._collector_to_names)


def exported() -> dict[str, frozenset[str]]:
    """Every series name a query may use (``_total``, ``_bucket``... included) -> its
    label names."""
    out: dict[str, frozenset[str]] = {}
    for registry in _registries():
        for collector in _collectors(registry):
            for family in collector.collect():
                labels = frozenset(getattr(collector, "_labelnames", ())
                                   or getattr(family, "_labelnames", ()))
                names = {"counter": [f"{family.name}_total"],
                         "histogram": [f"{family.name}_{s}" for s in ("bucket", "sum",
                                                                        "count")],
                         "gauge": [family.name], "info": [f"{family.name}_info"],
                         "summary": [f"{family.name}_{s}" for s in ("sum", "count")]}
                for name in names.get(family.type, [family.name]):
                    out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


def _base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", name)


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard panel target, dashboard variable and rule."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"]
           for t in p["targets"]]
    out += [(f"variable {v['name']}", v["definition"]) for v in
            dashboard["templating"]["list"] if v.get("type") == "query"]
    out += [(f"alert {r['alert']}", r["expr"]) for g in yaml.safe_load(RULES.read_text())[
        "groups"] for r in g["rules"]]
    return out


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(rota_[a-zA-Z0-9_]+)\b", expr))


def _selector_labels(expr: str) -> Iterable[tuple[str, str]]:
    for metric, body in re.findall(r"\b(rota_[a-zA-Z0-9_]+)\{([^}]*)\}", expr):
        for label in re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", body):
            yield metric, label
    for metric, label in re.findall(r"label_values\(\s*(rota_\w+)\s*,\s*(\w+)\s*\)", expr):
        yield metric, label


def _grouping_labels(expr: str) -> set[str]:
    found: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        found |= {label.strip() for label in group.split(",") if label.strip()}
    return found


@pytest.fixture(scope="module")
def have() -> dict[str, frozenset[str]]:
    return exported()


def test_the_audit_sees_the_components_metrics(have: dict[str, frozenset[str]]) -> None:
    # One metric of each component, so an empty registry cannot pass the audit.
    assert "rota_driver_slice_writes_total" in have
    assert "rota_controller_leader" in have
    assert "rota_gateway_requests_total" in have
    assert have["rota_driver_slice_writes_total"] == {"verb"}


def test_every_queried_metric_exists(have: dict[str, frozenset[str]]) -> None:
    unknown = []
    for where, expr in queries():
        for metric in _metrics_in(expr):
            if metric not in have and _base(metric) not in EXPECTED_MISSING \
                    and metric not in EXPECTED_MISSING:
                unknown.append(f"{where}: {metric}")
    assert not unknown


def test_every_queried_label_exists(have: dict[str, frozenset[str]]) -> None:
    unknown = []
    for where, expr in queries():
        used = {m for m in _metrics_in(expr) if m in have}
        for metric, label in _selector_labels(expr):
            if metric in have and label not in have[metric] | SCRAPE_LABELS \
                    and f"{metric}{{{label}}}" not in EXPECTED_MISSING:
                unknown.append(f"{where}: {metric}{{{label}}}")
        if used and not [m for m in _metrics_in(expr) if m not in have]:
            known = set().union(*(have[m] for m in used)) | SCRAPE_LABELS
            for label in _grouping_labels(expr) - known:
                if not any(f"{m}{{{label}}}" in EXPECTED_MISSING for m in used):
                    unknown.append(f"{where}: by ({label})")
    assert not unknown


def test_the_expected_missing_list_holds_nothing_that_exists(
        have: dict[str, frozenset[str]]) -> None:
    stale = []
    for entry in EXPECTED_MISSING:
        metric, _, label = entry.partition("{")
        label = label.rstrip("}")
        names = [n for n in have if _base(n) == metric or n == metric]
        if not label and names:
            stale.append(entry)
        if label and names and any(label in have[n] for n in names):
            stale.append(entry)
        if label and not names:
            stale.append(f"{entry} (the metric itself does not exist)")
    assert not stale, "renamed: remove these from EXPECTED_MISSING"
    used = {m for _, e in queries() for m in _metrics_in(e)} | {_base(m) for _, e in queries()
                                                               for m in _metrics_in(e)}
    unused = [e for e in EXPECTED_MISSING if e.partition("{")[0] not in used]
    assert not unused, "nothing queries these"


def test_every_dashboard_query_is_valid_promql(chart_bin: Path, tmp_path: Path) -> None:
    grafana = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
               "$node": ".*", "$model": ".*"}
    rules: list[dict[str, Any]] = []
    for i, (where, expr) in enumerate(queries()):
        if where.startswith("variable"):
            continue
        for variable, value in grafana.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, (where, expr)
        rules.append({"record": f"rota:dashboard_query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run_tool("promtool", ["check", "rules", str(path)], bin_dir=chart_bin,
                    check=False)
    assert done.returncode == 0, done.stdout + done.stderr
