"""Every metric the Grafana dashboard, the alerts and the alerts' promtool tests use exists
in what rota's components really export, with the labels they use (and, for the label sets
the components fix in advance, with those values); and every dashboard query is valid
PromQL (promtool parses it).

The exported metrics are read from the components' own registries (the driver's, the lease
controller's, and a gateway application's), after importing every module that registers
metrics. docs/metrics.md lists the same names.
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

from e2e.release.chart import CHART, run_tool

DASHBOARD = CHART / "files" / "dashboards" / "rota.json"
RULES = CHART / "files" / "prometheus" / "rules.yaml"
RULE_TEST_DIRS = (Path(__file__).parent, CHART / "files" / "prometheus")

SCRAPE_LABELS = frozenset({"node", "namespace", "pod", "instance", "job", "container",
                           "service", "endpoint"})
"""Labels the scrape adds (the chart's ServiceMonitor/PodMonitor add ``node``)."""


def closed_label_values() -> dict[tuple[str, str], frozenset[str]]:
    """(series, label) -> every value the components give that label: the label sets
    they fix in advance (and create at 0)."""
    from controller.lease import metrics as controller_metrics

    return {
        ("rota_controller_switches_total", "outcome"):
            frozenset(controller_metrics.SWITCH_OUTCOMES),
        ("rota_controller_switch_failures_total", "reason"):
            controller_metrics.SWITCH_FAILURE_REASONS,
        ("rota_controller_starts_total", "outcome"):
            frozenset(controller_metrics.START_OUTCOMES),
        ("rota_controller_reconcile_actions_total", "reason"):
            frozenset(controller_metrics.RECONCILE_REASONS),
        ("rota_controller_visible_state_errors_total", "kind"):
            frozenset(controller_metrics.VISIBLE_STATE_KINDS),
        ("rota_controller_sleep_duration_seconds_bucket", "first"):
            frozenset({"true", "false"}),
    }


def _registries() -> list[CollectorRegistry]:
    # Importing the applications imports every module that defines metrics.
    import driver.app  # noqa: F401
    from controller.gateway.metrics import GatewayMetrics
    from controller.lease import metrics as controller_metrics
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


def rule_test_files() -> list[Path]:
    """The promtool unit test files of the rules (``rule_files`` at their top)."""
    found = []
    for directory in RULE_TEST_DIRS:
        for path in sorted(directory.glob("*.yaml")):
            loaded = yaml.safe_load(path.read_text())
            if isinstance(loaded, dict) and "rule_files" in loaded:
                found.append(path)
    return found


def rule_test_series() -> list[tuple[str, str]]:
    """(where, series selector) of every input series of the rules' promtool tests."""
    return [(f"{path.name} {case['name']!r}", series["series"])
            for path in rule_test_files()
            for case in yaml.safe_load(path.read_text())["tests"]
            for series in case.get("input_series", [])]


def _metrics_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(rota_[a-zA-Z0-9_]+)\b", expr))


_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def _matchers(expr: str) -> Iterable[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher of a rota metric, and of
    the label a ``label_values(metric, label)`` variable reads (operator ``""``)."""
    for metric, body in re.findall(r"\b(rota_[a-zA-Z0-9_]+)\{([^}]*)\}", expr):
        for label, operator, value in _MATCHER.findall(body):
            yield metric, label, operator, value
    for metric, label in re.findall(r"label_values\(\s*(rota_\w+)\s*,\s*(\w+)\s*\)", expr):
        yield metric, label, "", ""


def _grouping_labels(expr: str) -> set[str]:
    found: set[str] = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        found |= {label.strip() for label in group.split(",") if label.strip()}
    return found


@pytest.fixture(scope="module")
def have() -> dict[str, frozenset[str]]:
    return exported()


def everything() -> list[tuple[str, str]]:
    return queries() + rule_test_series()


def test_the_audit_sees_the_components_metrics(have: dict[str, frozenset[str]]) -> None:
    # One metric of each component, so an empty registry cannot pass the audit.
    assert "rota_driver_slice_writes_total" in have
    assert "rota_controller_leader" in have
    assert "rota_gateway_requests_total" in have
    assert have["rota_driver_slice_writes_total"] == {"verb"}
    # And something of each source, so a file that stopped parsing cannot pass either.
    assert [w for w, _ in queries() if w.startswith("panel")]
    assert [w for w, _ in queries() if w.startswith("alert")]
    assert rule_test_series()


def test_every_component_reports_its_version_and_process(
        have: dict[str, frozenset[str]]) -> None:
    assert have["rota_driver_info"] == {"version", "sharing_mode"}
    assert have["rota_controller_info"] == {"version"}
    assert have["rota_gateway_info"] == {"version"}
    from controller.gateway.metrics import GatewayMetrics
    from controller.lease import metrics as controller_metrics
    from driver import metrics as driver_metrics

    for registry in (driver_metrics.REGISTRY, controller_metrics.REGISTRY,
                     GatewayMetrics(gate_counts=dict).registry):
        names = {family.name for family in registry.collect()}
        assert {"process_cpu_seconds", "python_info"} <= names, names


def test_every_queried_metric_exists(have: dict[str, frozenset[str]]) -> None:
    unknown = [f"{where}: {metric}" for where, expr in everything()
               for metric in _metrics_in(expr) if metric not in have]
    assert not unknown


def test_every_queried_label_exists(have: dict[str, frozenset[str]]) -> None:
    unknown = []
    for where, expr in everything():
        for metric, label, _, _ in _matchers(expr):
            if metric in have and label not in have[metric] | SCRAPE_LABELS:
                unknown.append(f"{where}: {metric}{{{label}}}")
        used = [m for m in _metrics_in(expr) if m in have]
        if used:
            known = set().union(*(have[m] for m in used)) | SCRAPE_LABELS
            unknown += [f"{where}: by ({label})" for label in _grouping_labels(expr) - known]
    assert not unknown


def test_every_selected_value_of_a_fixed_label_set_exists() -> None:
    closed = closed_label_values()
    unknown = []
    for where, expr in everything():
        for metric, label, operator, value in _matchers(expr):
            values = closed.get((metric, label))
            if values is None:
                continue
            if operator in ("=", "!=") and value not in values:
                unknown.append(f"{where}: {metric}{{{label}={value!r}}}")
            if operator in ("=~", "!~"):
                unknown += [f"{where}: {metric}{{{label}=~{part!r}}}"
                            for part in value.split("|")
                            if re.fullmatch(r"\w+", part) and part not in values]
    assert not unknown


def test_the_fixed_label_sets_are_created_at_zero(have: dict[str, frozenset[str]]) -> None:
    from controller.lease import metrics as controller_metrics

    seen: dict[tuple[str, str], set[str]] = {}
    for family in controller_metrics.REGISTRY.collect():
        for sample in family.samples:
            for label, value in sample.labels.items():
                seen.setdefault((sample.name, label), set()).add(value)
    for (series, label), values in closed_label_values().items():
        if series.endswith("_bucket"):
            continue  # a histogram's labels come with its first observation
        assert values <= seen.get((series, label), set()), (series, label)


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


def test_docs_list_every_gateway_metric() -> None:
    """docs/metrics.md names every metric family of the gateway's registry (the process
    and platform collectors aside)."""
    from controller.gateway.metrics import GatewayMetrics

    doc = (CHART.parent.parent / "docs" / "metrics.md").read_text()
    listed = set(re.findall(r"`(rota_[a-z0-9_]+)`", doc))
    families = {family.name + ("_total" if family.type == "counter" else "")
                for family in GatewayMetrics(gate_counts=dict).registry.collect()
                if family.name.startswith("rota_gateway_")}
    assert "rota_gateway_forbidden_namespaces" in families
    assert families - listed == set()
